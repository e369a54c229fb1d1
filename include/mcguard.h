/*
 * mcguard.h — the public C API of libmcguard.
 *
 * mcguard turns "sent" into "delivered" for KV-cache transfers between a
 * prefill (sending) and a decode (receiving) process: mc_guard_transfer
 * returns MC_OK only after the destination bytes were confirmed at the
 * target by the configured verification, never when they were merely sent.
 *
 * Every guard is both a sender and a receiver ("target"). A guard is
 * reachable by peers under its endpoint "host:port" (mc_guard_endpoint);
 * that string is the session name peers pass to mc_guard_transfer, as a
 * Mooncake session is "host:rpc_port".
 *
 * Conventions
 *  - Every function returns an mc_status: MC_OK (0) or a negative code.
 *    After a failure, mc_guard_last_error gives the message, per thread.
 *  - Handles are integers; 0 is never a valid handle. A bogus or closed
 *    handle gives MC_ERR_BAD_HANDLE, never a crash.
 *  - The library keeps no pointer you pass it after the call returns,
 *    except the memory you register, which it reads and writes (as source
 *    and as target for peers) until you unregister it or close the guard.
 *  - All functions are thread safe. Transfers to one session are
 *    serialised; transfers to different sessions run in parallel.
 *
 * Process rules (libmcguard embeds a Go runtime)
 *  - One Go runtime per process: do not load a second Go c-shared library.
 *  - Never dlclose libmcguard.
 *  - After fork(), the child must not use the library: every call in a
 *    child returns MC_ERR_FORKED without entering the runtime (it would
 *    hang). Open guards in the child after exec, or use spawn-style
 *    process creation.
 */
#ifndef MCGUARD_H
#define MCGUARD_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MC_GUARD_VERSION_MAJOR 0
#define MC_GUARD_VERSION_MINOR 3
#define MC_GUARD_VERSION_PATCH 3
#define MC_GUARD_VERSION_STRING "0.3.3"

/* Largest descriptor count of one mc_guard_transfer call. Any count up to
 * it works; the library chunks it at the max_batch setting. */
#define MC_GUARD_MAX_DESCRIPTORS (1u << 24)

/* A guard handle. 0 is never valid. */
typedef uint64_t mc_guard_t;

/* Status codes. Negative values are errors. */
typedef int32_t mc_status;
#define MC_OK                    0
#define MC_ERR_INVALID_ARG      -1  /* null pointer, zero count or length, count over the limit */
#define MC_ERR_BAD_HANDLE       -2  /* handle unknown or already closed */
#define MC_ERR_CONFIG           -3  /* bad configuration JSON or environment value, or cannot listen */
#define MC_ERR_NOT_REGISTERED   -4  /* an address range outside registered memory (local or at the peer) */
#define MC_ERR_SESSION          -5  /* session refused or broke the handshake */
#define MC_ERR_TIMEOUT          -6  /* a peer did not answer within its deadline (dead or unreachable) */
#define MC_ERR_PEER             -7  /* the connection to a peer failed or the peer sent nonsense */
#define MC_ERR_VERIFY           -8  /* bytes did not match at the target after all retries */
#define MC_ERR_CLOSED           -9  /* the guard was closed while the call was in flight */
#define MC_ERR_FORKED          -10  /* called in a child process after fork() */
#define MC_ERR_BUFFER_TOO_SMALL -11 /* an output buffer cannot hold the result */
#define MC_ERR_INTERNAL        -12  /* a bug in mcguard (a recovered panic); the message says where */
#define MC_ERR_DEVICE          -13  /* a GPU copy or synchronisation failed, or device memory without a usable CUDA driver */
#define MC_ERR_QUIESCED        -14  /* the receiver quiesced a destination after the write was sent: refused */
#define MC_ERR_CANCELLED       -15  /* mc_guard_cancel cancelled the transfer */
#define MC_ERR_NO_MEMORY       -16  /* the system refused memory for mc_guard_alloc (since 0.3.1) */
#define MC_ERR_SEAL            -17  /* a seal that is malformed, truncated, forged, from another producer, or not for the ranges read */

/* Verification modes, for mc_transfer_opts.verify. */
#define MC_VERIFY_DEFAULT -1 /* the guard's configured mode */
#define MC_VERIFY_OFF      0 /* check nothing (regression baseline) */
#define MC_VERIFY_TAIL     1 /* read back each descriptor's last tail_bytes, poll until equal */
#define MC_VERIFY_SAMPLE   2 /* read back head, tail and sample_stripes seeded stripes per descriptor */
#define MC_VERIFY_FULL     3 /* read back every byte (debugging, validation) */
#define MC_VERIFY_DIGEST   4 /* end to end: xxh3-64 per descriptor, compared by the receiver in mc_guard_sync */

/* Flags of mc_transfer_opts. */
#define MC_TRANSFER_NO_NOTICE 1u /* send no completion notice (the application forwards the digests itself) */

/* mc_transfer_opts.abort_state after a failed transfer: what is known of
 * its bytes still on their way to the destination. */
#define MC_ABORT_NONE        0 /* nothing was sent (or the transfer succeeded) */
#define MC_ABORT_CONFIRMED   1 /* the receiver confirmed that nothing more of it will land */
#define MC_ABORT_UNCONFIRMED 2 /* unknown: the receiver must mc_guard_quiesce the ranges before reusing them */

/* Log levels, for mc_guard_set_log and the log_level setting. */
#define MC_LOG_ERROR 0
#define MC_LOG_WARN  1 /* the default: only warnings (fault injection on, listening without a secret) and errors */
#define MC_LOG_INFO  2 /* also refused handshakes, transport choices, accept retries */
#define MC_LOG_DEBUG 3

/* A log sink: a message (NUL-terminated, valid during the call only) at a
 * level. It is called from the library's own threads, possibly several at
 * once. */
typedef void (*mc_log_fn)(int32_t level, const char *message, void *ctx);

/* Options of one transfer. Set struct_size = sizeof(mc_transfer_opts) so
 * later versions can grow the struct; zero-initialise the rest; pass NULL
 * for the defaults. */
typedef struct mc_transfer_opts {
    uint32_t struct_size;
    int32_t verify;       /* MC_VERIFY_*; MC_VERIFY_DEFAULT for the guard's mode */
    uint32_t flags;       /* MC_TRANSFER_* */
    uint32_t reserved;
    uint64_t *digests;    /* out, optional: n xxh3-64 digests of the sources */
    uint64_t transfer_id; /* out: the transfer's id (mc_guard_sync_transfers; after a failure, mc_guard_wait_engine_calls) */
    uint64_t retries;     /* out: verification polling rounds it needed */
    uint64_t resends;     /* out: rounds of re-sending descriptors that did not match */
    /* Since 0.3 (a 0.2 caller's smaller struct_size is still taken): */
    uint64_t deadline_ms; /* in: > 0 fails the transfer with MC_ERR_TIMEOUT past it */
    int32_t abort_state;  /* out, after a failure: MC_ABORT_* */
    uint32_t reserved2;
} mc_transfer_opts;

/* Options of one sync. Set struct_size = sizeof(mc_sync_opts), zero the
 * rest; NULL for the defaults. */
typedef struct mc_sync_opts {
    uint32_t struct_size;
    uint32_t reserved;
    uint64_t stream;          /* a CUstream to synchronise, or 0 (unused for host memory) */
    const uint64_t *digests;  /* mc_guard_sync only: n digests to compare, or NULL */
} mc_sync_opts;

/* The application's own transfer engine as a guard's data plane
 * (mc_guard_open_with_transport): the engine moves the bytes, the guard
 * verifies them by reading back through it. Every callback gets the ctx
 * given at open, returns MC_OK or a negative MC_ERR_* (MC_ERR_PEER,
 * MC_ERR_TIMEOUT, MC_ERR_NOT_REGISTERED...; anything else reads as
 * MC_ERR_PEER) and on failure may write a NUL-terminated message of at
 * most msg_len bytes into msg. The arrays are valid during the call only.
 * Calls for different sessions may run at once; calls for one session
 * come one at a time, except writes that fault injection (inject) holds
 * back. The callbacks run on the library's own threads, and a transfer
 * fails at its deadline_ms, or timeout_ms after a call began where it has
 * none, or at mc_guard_cancel (MC_ERR_TIMEOUT / MC_ERR_CANCELLED, bytes may
 * still land) while the call finishes on its own and its result is
 * dropped, even one that never returns (a library thread that ran a call
 * waits awake engine_busy_poll_us, default 200, for the next one; the
 * caller as long for the answer). With engine_inline_calls they run
 * on the thread that called mc_guard_transfer instead (no hand-off), and a
 * call that returns past its deadline fails then: cancel and close take
 * effect once it returns.
 * What the engine is trusted with: read-back modes (tail, sample, full)
 * read the destination back through the engine, so they prove what its
 * read path returns; digest mode with the receiver's
 * mc_guard_sync_transfers is checked in the receiver's memory by its
 * guard, and does not trust the engine. */

/* Move n ranges: len[i] bytes between local[i] (this process's memory,
 * registered with the engine) and remote[i] at session (the engine's name
 * for the peer), local to remote for write, remote to local for read;
 * return once the engine reports all of them complete. */
typedef mc_status (*mc_transport_batch_fn)(void *ctx, const char *session, const uint64_t *local,
                                          const uint64_t *remote, const uint64_t *len, size_t n,
                                          char *msg, size_t msg_len);
/* Make [addr, addr+len) the engine's (a source, or read-back scratch). */
typedef mc_status (*mc_transport_register_fn)(void *ctx, uint64_t addr, uint64_t len, char *msg, size_t msg_len);
typedef mc_status (*mc_transport_unregister_fn)(void *ctx, uint64_t addr, char *msg, size_t msg_len);
/* Return once every write the engine completed to session is in place. */
typedef mc_status (*mc_transport_fence_fn)(void *ctx, const char *session, char *msg, size_t msg_len);

/* Set struct_size = sizeof(mc_transport_ops); write and read are
 * required, the rest may be NULL. */
typedef struct mc_transport_ops {
    uint32_t struct_size;
    uint32_t reserved;
    const char *name;                             /* "mooncake", ... (copied at open; may be NULL) */
    mc_transport_batch_fn write;
    mc_transport_batch_fn read;
    mc_transport_register_fn register_memory;     /* optional: every mc_guard_register, and scratch */
    mc_transport_unregister_fn unregister_memory; /* optional */
    mc_transport_fence_fn fence;                  /* optional: without it read-backs poll */
} mc_transport_ops;

/* Open a guard. config_json may be NULL or "" for defaults, else a JSON
 * object; keys (and MC_GUARD_* variables; JSON wins over environment):
 *   listen "host:port" (default "127.0.0.1:0"; an IPv4 address, a bracketed
 *   IPv6 address such as "[::1]:0", or a host name), verify "off"|"tail"|
 *   "sample"|"full"|"digest" or true/false, tail_bytes, sample_stripes,
 *   sample_bytes, max_retries, retry_sleep_s, on_mismatch "fail"|"resend",
 *   max_resends, max_batch, timeout_ms, connect_timeout_ms, notify
 *   "auto"|"always"|"never", sync_timeout_ms, inject "none"|"lag"|"drop"|
 *   "tear"|"reorder"|"stale"|"hold", inject_rate, inject_lag_max_ms, inject_seed,
 *   secret, secret_file, allow_insecure, cuda "auto"|"required"|"off",
 *   cuda_library, transport "tcp"|"rdma"|"auto", require_rdma, log_level
 *   "error"|"warn"|"info"|"debug" (for the process),
 *   verbs_library, rdma_device, rdma_gid_index, rdma_qps (1 to 16),
 *   tcp_stripes (1 to 8: TCP connections a large batch is striped over),
 *   busy_poll_us (0 to 1000, default 50: a TCP read expecting bytes soon
 *   spins this long before its thread sleeps),
 *   same_host "auto"|"off"|"required" (on one machine the receiver copies
 *   the bytes out of the sender: process_vm_readv, and GPU memory by
 *   CUDA IPC), same_host_writer "sender"|"receiver" (receiver side: a
 *   same-host sender writes host memory into this process itself, under
 *   a lease that unregister, quiesce and aborts honour, or this process
 *   copies it out of the sender), digest_at "sync"|"landing" (the receiver's digest-mode
 *   sync reads its memory, or compares digests its TCP target took as
 *   the bytes landed, where it could), slice_bytes (tail and
 *   sample check the tail of every slice of this size; over an engine
 *   named "mooncake" MC_SLICE_SIZE by default, else 0).
 * The vLLM variables VLLM_MOONCAKE_TRANSFER_VERIFY[_TAIL_BYTES|
 * _MAX_RETRIES|_RETRY_SLEEP_S] are honoured too. On success *out is the
 * new handle. MC_ERR_CONFIG names every bad key or value. */
mc_status mc_guard_open(const char *config_json, mc_guard_t *out);

/* Open a guard whose data plane is the application's engine (ops, called
 * with ctx; ops is copied, its callbacks and ctx must stay valid until
 * mc_guard_close returns). config_json as for mc_guard_open, except
 * transport and require_rdma; slice_bytes defaults to the engine's slice
 * size where known (name "mooncake": MC_SLICE_SIZE, else 64 KiB), so tail
 * and sample check the tail of every slice; inject faults the callbacks
 * (lag, drop, tear, reorder, hold). Sessions are the engine's names for
 * its peers, reached without a handshake: read-back modes need nothing
 * from the receiver. Digest mode's notices need the peer's guard
 * (mc_guard_set_peer_guard), or notify "never" and the digests forwarded
 * to the receiver's mc_guard_sync. mc_guard_quiesce fails on such a
 * guard (MC_ERR_TIMEOUT, saying why): the engine's writes do not pass
 * through mcguard. Errors: as mc_guard_open; MC_ERR_CONFIG also for ops
 * without write or read. */
mc_status mc_guard_open_with_transport(const char *config_json, const mc_transport_ops *ops, void *ctx,
                                       mc_guard_t *out);

/* For a guard over an engine: the peer the engine calls session has a
 * guard listening at endpoint ("host:port", its mc_guard_endpoint), where
 * completion notices, notifies and region-table requests go.
 * MC_ERR_INVALID_ARG on a guard over mcguard's own data plane. */
mc_status mc_guard_set_peer_guard(mc_guard_t g, const char *session, const char *endpoint);

/* Close a guard. Transfers in flight on other threads fail with
 * MC_ERR_CLOSED; close waits for them. The handle is invalid afterwards
 * and registered memory is no longer touched: you may free it. */
mc_status mc_guard_close(mc_guard_t g);

/* Register [addr, addr+len): usable as a transfer source, and writable
 * and readable by peers that handshake with this guard. Regions must not
 * overlap. The memory must stay valid until unregistered or closed. With
 * libcuda loaded (cuda "auto"), the driver classifies the memory once,
 * here: device memory is then copied through pinned staging buffers, so
 * host and device regions can be mixed in one batch. With the RDMA
 * transport the region also becomes a memory region of the NIC: device
 * memory as a dmabuf (CUDA 11.7+, ibv_reg_dmabuf_mr), else as a device
 * pointer (nvidia-peermem), else MC_ERR_DEVICE saying what is missing. */
mc_status mc_guard_register(mc_guard_t g, void *addr, size_t len);

/* Register [addr, addr+len) that the caller knows is GPU memory (a CUDA
 * device pointer). mc_guard_register finds that out by itself when libcuda
 * is loaded; this call makes it an error (MC_ERR_DEVICE, with the reason:
 * no driver, or not device memory) instead of a guess when it is not. */
mc_status mc_guard_register_device(mc_guard_t g, void *addr, size_t len);

/* Unregister the region starting at addr. Waits for accesses in
 * progress; afterwards peers' writes to it are refused. MC_ERR_TIMEOUT:
 * a same-host sender that writes into this process itself did not finish
 * its write within the timeout (it is stopped, say); the region is out of
 * the table, but its memory must not be reused until that sender is gone. */
mc_status mc_guard_unregister(mc_guard_t g, void *addr);

/* Since 0.3.1. Allocate len bytes (rounded up to whole pages) of zeroed host memory,
 * registered, into *out. It is a sealed shared memory file (memfd): a
 * sender on the same host that may write this process's memory maps it
 * and writes with memcpy, and checks a tail with memcmp, instead of two
 * cross-memory system calls per transfer, which makes small same-host
 * transfers several times faster. Use it for receive buffers (the KV
 * cache). Errors: MC_ERR_INVALID_ARG (len 0, out NULL), MC_ERR_NO_MEMORY
 * (the system refused it; the message says why). mc_guard_close frees
 * every allocation of the guard. */
mc_status mc_guard_alloc(mc_guard_t g, size_t len, void **out);

/* Free an allocation of mc_guard_alloc: for every registered region in it
 * (the whole, or what you registered of it after unregistering it),
 * writes sent into it before are quiesced and it is unregistered (waiting
 * for accesses in progress); then it is unmapped. A same-host sender that mapped it lets go of its pages at its
 * next transfer to this guard, or when its connection ends. MC_ERR_INVALID_ARG
 * for an address mc_guard_alloc did not return; MC_ERR_TIMEOUT as
 * mc_guard_unregister, with the memory still allocated (free again later,
 * or close). */
mc_status mc_guard_free(mc_guard_t g, void *addr);

/* Write n descriptors to session ("host:port" of the receiving guard):
 * len[i] bytes from local src[i] (registered here) to remote dst[i]
 * (registered at the peer). Returns MC_OK only after verification
 * confirmed the bytes at the target: read-back modes fence the writes,
 * read back and compare (re-sending up to max_resends times if
 * on_mismatch is "resend"); digest mode fences and sends the receiver a
 * completion notice with the digests (notify "auto"), so the bytes are
 * checked by the receiver's mc_guard_sync_transfers (on one host, where
 * the sender wrote the bytes itself, it returns once the notice is sent;
 * a refused notice fails a later call to the session with MC_ERR_SESSION,
 * naming that transfer). n may be anything from 1 to
 * MC_GUARD_MAX_DESCRIPTORS; every len[i] must be > 0. The arrays are read
 * during the call only. opts may be NULL. Descriptors that continue one
 * another (src[i] + len[i] == src[i+1] and dst[i] + len[i] == dst[i+1],
 * a cache's consecutive blocks) go as one write of up to 4 MiB over the
 * TCP data plane (host memory at both ends) and RDMA, inside one
 * registered region at each end; each is still verified on its own.
 * Errors: MC_ERR_INVALID_ARG, MC_ERR_NOT_REGISTERED (names the descriptor,
 * or the descriptors a refused joined write carried),
 * MC_ERR_SESSION, MC_ERR_TIMEOUT, MC_ERR_PEER, MC_ERR_VERIFY (names the
 * descriptors that never matched), MC_ERR_CLOSED, MC_ERR_QUIESCED,
 * MC_ERR_CANCELLED. On any error the destination may hold some, all or
 * none of the new bytes; opts->abort_state says whether more may still
 * land (see mc_guard_quiesce; over an engine, mc_guard_wait_engine_calls
 * with opts->transfer_id, 0 if the call failed before the transfer began). */
mc_status mc_guard_transfer(mc_guard_t g, const char *session,
                            const uint64_t *src, const uint64_t *dst,
                            const uint64_t *len, size_t n,
                            mc_transfer_opts *opts);

/* Cancel the transfers in flight to session (from other threads): each
 * returns MC_ERR_CANCELLED once its writes are cut off locally, with
 * opts->abort_state saying whether the receiver confirmed that nothing
 * more of it will land. MC_OK also when there was none. */
mc_status mc_guard_cancel(mc_guard_t g, const char *session);

/* Since 0.3.2. Over an engine (mc_guard_open_with_transport), after a failed or
 * cancelled transfer: return once no engine call the guard made for
 * transfer_id (opts->transfer_id) is still running, writes held by fault
 * injection included, waiting at most timeout_ms (0: do not wait, only
 * say). Nothing at the receiver can refuse an engine's late write, so do
 * not write the failed transfer's blocks again before this returns MC_OK.
 * Other transfers' calls are not waited for (stats' engine_calls_in_flight
 * counts them all). It cannot see slices the engine itself still runs
 * after its call returned. Errors: MC_ERR_INVALID_ARG (not over an engine:
 * there abort_state and mc_guard_quiesce say it; an id this guard did not
 * give), MC_ERR_TIMEOUT (calls still running: names how many),
 * MC_ERR_CLOSED. */
mc_status mc_guard_wait_engine_calls(mc_guard_t g, uint64_t transfer_id, uint64_t timeout_ms);

/* Since 0.3.3. Over an engine, on the sending side: the receiver at
 * session (the engine's name for it) quiesced the n ranges
 * [addr[i], addr[i]+len[i]) of its memory and the application brought
 * them here over its own channel (a receiver's mc_guard_quiesce cannot
 * refuse an engine's write: the engine writes without mcguard). From now
 * on no engine call of a transfer that began before this call writes
 * into them (such a transfer fails with MC_ERR_QUIESCED; writes held by
 * fault injection are dropped), and this returns once no engine call to
 * session of such a transfer is still running, so the receiver may reuse
 * the ranges when it is told. Slices the engine runs after its call
 * returned stay beyond it. Errors: MC_ERR_INVALID_ARG (not over an engine,
 * n of 0 or over MC_GUARD_MAX_DESCRIPTORS, an empty range), MC_ERR_TIMEOUT
 * (sync_timeout_ms: calls still running, naming how many),
 * MC_ERR_CLOSED. */
mc_status mc_guard_quiesce_engine(mc_guard_t g, const char *session, const uint64_t *addr, const uint64_t *len,
                                  size_t n);

/* Read n descriptors back from session: len[i] bytes from remote
 * remote[i] (registered at the peer) into local[i] (registered here), as
 * Mooncake's batch_transfer_sync_read. Same errors as mc_guard_transfer
 * except MC_ERR_VERIFY. */
mc_status mc_guard_read(mc_guard_t g, const char *session,
                        const uint64_t *local, const uint64_t *remote,
                        const uint64_t *len, size_t n);

/* Verified reads (NIXL's pull model: the decode side reads the prefill
 * side's blocks). The producer seals ranges once their bytes are final;
 * the application carries the seal to the reader with its own metadata
 * (vLLM's kv_transfer_params, say); the reader's read succeeds only when
 * the bytes it landed are the sealed ones. A producer that reuses sealed
 * blocks before every reader has read them makes those reads fail with
 * MC_ERR_VERIFY, never succeed with the new bytes.
 *
 * What each check proves of the bytes in [local[i], +len[i]) once the read
 * returned: MC_VERIFY_DIGEST (and MC_VERIFY_DEFAULT) that every byte
 * equals what the producer sealed (xxh3-64, per range: against accidental
 * corruption, reuse and partial reads; the MAC, where the guards share a
 * secret, against a forged seal). MC_VERIFY_TAIL that the last 16 bytes of
 * each range landed and equal the sealed ones: a read that stopped short
 * of a range's end or a block reused from its end fails; a middle that
 * differs does not. Neither proves anything of bytes outside the ranges.
 *
 * A seal is at most MC_GUARD_SEAL_SIZE(n) bytes and names its producer
 * (mc_guard_id). With a shared secret it carries an HMAC-SHA256 under it,
 * and a guard with a secret accepts only seals that do; a guard without
 * one accepts only seals without. */
#define MC_GUARD_SEAL_SIZE(n) (40u + 40u * (size_t)(n) + 32u)
#define MC_GUARD_ID_SIZE 16u

/* Producer: seal the n ranges [addr[i], +len[i]) of registered memory
 * (digests taken where the bytes are, GPU memory included) into seal
 * (cap bytes); *seal_len (if not NULL) receives its length, also when
 * MC_ERR_BUFFER_TOO_SMALL. The bytes must not change until every reader
 * has read them. Errors: MC_ERR_INVALID_ARG (n of 0 or over
 * MC_GUARD_MAX_DESCRIPTORS, an empty range, seal NULL),
 * MC_ERR_NOT_REGISTERED, MC_ERR_BUFFER_TOO_SMALL, MC_ERR_DEVICE. */
mc_status mc_guard_seal(mc_guard_t g, const uint64_t *addr, const uint64_t *len, size_t n,
                        uint8_t *seal, size_t cap, size_t *seal_len);

/* Reader: mc_guard_read, then the landed bytes checked against seal in
 * mode (MC_VERIFY_DIGEST, MC_VERIFY_TAIL or MC_VERIFY_DEFAULT). Each range
 * read must be a sealed range: [remote[i], +len[i]) range i of the seal,
 * or, for a read of some of the sealed ranges or in another order, the
 * sealed range at that address with that length. The seal must come
 * from the guard the session's handshake reached (over an engine, the
 * peer's guard where mc_guard_set_peer_guard named it). Errors: those of
 * mc_guard_read, MC_ERR_SEAL (checked before any byte moves, and the
 * producer after the handshake), MC_ERR_VERIFY (names the ranges that
 * differ). */
mc_status mc_guard_read_sealed(mc_guard_t g, const char *session, const uint64_t *local,
                               const uint64_t *remote, const uint64_t *len, size_t n,
                               const uint8_t *seal, size_t seal_len, int32_t mode);

/* Reader, after a read another engine made (NIXL, say): check the bytes
 * landed in [local[i], +len[i]) (registered here) against seal in mode.
 * remote, where not NULL, names the sealed ranges read (as for
 * mc_guard_read_sealed; NULL: the seal's ranges in order); producer, where
 * not NULL, the MC_GUARD_ID_SIZE bytes of the producer's mc_guard_id.
 * Errors: MC_ERR_INVALID_ARG, MC_ERR_NOT_REGISTERED, MC_ERR_SEAL,
 * MC_ERR_VERIFY (names the ranges that differ), MC_ERR_DEVICE. */
mc_status mc_guard_check_seal(mc_guard_t g, const uint64_t *local, const uint64_t *remote,
                              const uint64_t *len, size_t n, const uint8_t *seal, size_t seal_len,
                              int32_t mode, const uint8_t *producer);

/* Producer: seal the n ranges as mc_guard_seal does and keep the seal
 * under name (NUL-terminated, at most 256 bytes: a request id) for readers
 * to fetch from this guard with mc_guard_fetch_seal, where it cannot travel
 * in the application's own metadata. Publishing under a name again
 * replaces its seal. The guard keeps at most 4096 seals and 64 MiB of
 * them, the oldest forgotten first; one seal at most 1 MiB (about 26,000
 * ranges). Errors: those of mc_guard_seal, MC_ERR_INVALID_ARG (name NULL,
 * empty or too long, a seal too large to fetch). */
mc_status mc_guard_publish(mc_guard_t g, const char *name, const uint64_t *addr, const uint64_t *len, size_t n);

/* Producer: forget the seal published under name (its blocks handed back);
 * readers that come for it are told there is none. MC_ERR_INVALID_ARG if
 * there was none. */
mc_status mc_guard_withdraw(mc_guard_t g, const char *name);

/* Reader: fetch the seal session's guard published under name (over an
 * engine, the peer guard mc_guard_set_peer_guard named), asking again until
 * it is published or timeout_ms passes (MC_ERR_TIMEOUT), into seal (cap
 * bytes; *seal_len its length, also when MC_ERR_BUFFER_TOO_SMALL). The
 * seal is checked when it is used. Errors: MC_ERR_INVALID_ARG, MC_ERR_CONFIG
 * (an engine's session without its peer's guard), MC_ERR_SESSION,
 * MC_ERR_TIMEOUT, MC_ERR_BUFFER_TOO_SMALL. */
mc_status mc_guard_fetch_seal(mc_guard_t g, const char *session, const char *name, uint64_t timeout_ms,
                              uint8_t *seal, size_t cap, size_t *seal_len);

/* This guard's identity, the producer its seals name: MC_GUARD_ID_SIZE
 * bytes into id (cap at least that, else MC_ERR_BUFFER_TOO_SMALL). */
mc_status mc_guard_id(mc_guard_t g, uint8_t *id, size_t cap);

/* Receiver side, for ranges the application was told about (its own "done"
 * message): wait until writes still in flight to the n ranges
 * [addr[i], addr[i]+len[i]) have landed, make them safe to read, and if
 * opts->digests is set compare each range's xxh3-64 with digests[i] (the
 * sender's mc_transfer_opts.digests). For ranges in GPU memory it calls
 * cuFlushGPUDirectRDMAWrites, then synchronises opts->stream (a CUstream;
 * torch.cuda.current_stream().cuda_stream) or, if 0, the context. n may be
 * 0 (synchronise only).
 * Errors: MC_ERR_INVALID_ARG, MC_ERR_NOT_REGISTERED, MC_ERR_TIMEOUT
 * (sync_timeout_ms), MC_ERR_VERIFY (names the bad ranges). */
mc_status mc_guard_sync(mc_guard_t g, const uint64_t *addr,
                        const uint64_t *len, size_t n,
                        const mc_sync_opts *opts);

/* Receiver side, for transfers announced by completion notices: wait (up
 * to sync_timeout_ms) for the notice of each of the n transfer ids, then
 * settle its ranges as mc_guard_sync does, comparing digests when it was
 * sent in digest mode. Each notice is consumed. A transfer is named by the
 * id the sender's mc_guard_transfer returned (opts->transfer_id), which
 * the application forwards in its own "done" message: ids never repeat
 * within a sending guard and cannot be predicted by another peer, and a
 * notice is kept under the sender whose handshake it proved. Where two
 * senders sent notices under one id, neither is believed: the sync of it
 * fails with MC_ERR_SESSION. Errors: MC_ERR_INVALID_ARG, MC_ERR_TIMEOUT
 * (no notice), MC_ERR_SESSION (the notice was dropped: too many unsynced,
 * from its sender or in all; or two senders claimed the id),
 * MC_ERR_VERIFY (names the transfer and descriptors whose digests
 * differ). */
mc_status mc_guard_sync_transfers(mc_guard_t g, const uint64_t *transfer_ids,
                                  size_t n, const mc_sync_opts *opts);

/* Receiver side, before reusing ranges whose transfer failed or whose
 * request was aborted: returns once no write into the n ranges that was
 * sent before the call can land any more. Writes being applied finish
 * first; writes still on their way (queued on a connection, held up on a
 * slow or partitioned path) are refused when they arrive, and their
 * transfer fails with MC_ERR_QUIESCED. Other traffic goes on. Over TCP
 * the target refuses them itself; over RDMA the regions holding the
 * ranges are registered again under new rkeys (each sender's next
 * transfer after it fails once and reconnects). Errors:
 * MC_ERR_INVALID_ARG, MC_ERR_NOT_REGISTERED, MC_ERR_TIMEOUT. */
mc_status mc_guard_quiesce(mc_guard_t g, const uint64_t *addr, const uint64_t *len, size_t n);

/* Copy this guard's endpoint, the session name peers use, into buf as a
 * NUL-terminated string. MC_ERR_BUFFER_TOO_SMALL if it does not fit. */
mc_status mc_guard_endpoint(mc_guard_t g, char *buf, size_t len);

/* The regions session has registered, in the order it registered them,
 * from a fresh handshake (connecting first if need be): up to cap of them
 * into addr[] and len[]. *n (if not NULL) receives how many there are,
 * also when MC_ERR_BUFFER_TOO_SMALL; cap 0 with NULL arrays asks only the
 * count. Mooncake's get_first_buffer_address is addr[0]. Errors:
 * MC_ERR_INVALID_ARG, MC_ERR_SESSION, MC_ERR_PEER, MC_ERR_TIMEOUT. */
mc_status mc_guard_peer_regions(mc_guard_t g, const char *session, uint64_t *addr, uint64_t *len, size_t cap,
                                size_t *n);

/* Mooncake's TransferNotify. Send name (NUL-terminated, at most 256 bytes)
 * and msg (msg_len bytes, at most 64 KiB), both UTF-8, to session, where
 * they wait for the receiver's mc_guard_notifies; returns once the
 * receiver queued them. Send it after the transfer it tells about
 * returned MC_OK. A receiver holds at most 1024 per sender and 64 MiB in
 * all; past that its sends fail. Errors: MC_ERR_INVALID_ARG,
 * MC_ERR_SESSION (refused), MC_ERR_PEER, MC_ERR_TIMEOUT. */
mc_status mc_guard_notify(mc_guard_t g, const char *session, const char *name, const char *msg, size_t msg_len);

/* Take the notifies received so far, oldest first, as a NUL-terminated
 * JSON array of {"name": ..., "msg": ...} ("[]" when none). When the array
 * does not fit, MC_ERR_BUFFER_TOO_SMALL, *needed (if not NULL) its length
 * without the NUL, and the notifies stay queued. */
mc_status mc_guard_notifies(mc_guard_t g, char *buf, size_t len, size_t *needed);

/* Copy the guard's counters and settings as a JSON object into buf,
 * NUL-terminated. If needed is not NULL it receives the length the JSON
 * requires (without the NUL), also when MC_ERR_BUFFER_TOO_SMALL. */
mc_status mc_guard_stats(mc_guard_t g, char *buf, size_t len, size_t *needed);

/* Copy the guard's metrics, in the Prometheus text exposition format
 * (version 0.0.4: mcguard_* counters, gauges and histograms), into buf,
 * NUL-terminated; needed as for mc_guard_stats. */
mc_status mc_guard_metrics(mc_guard_t g, char *buf, size_t len, size_t *needed);

/* The message of the last failed call this thread made with handle g
 * (g = 0: the last failed mc_guard_open on this thread). Copies
 * at most len-1 bytes and a NUL into buf (when len > 0) and returns the
 * full message length, like snprintf; "" and 0 if there is none. */
size_t mc_guard_last_error(mc_guard_t g, char *buf, size_t len);

/* Set where the library's messages go, for the whole process: level
 * (MC_LOG_*; -1 keeps the current one; the log_level setting and
 * MC_GUARD_LOG_LEVEL set it too) and fn with ctx (NULL: standard error,
 * the default). MC_ERR_INVALID_ARG for an unknown level. */
mc_status mc_guard_set_log(int32_t level, mc_log_fn fn, void *ctx);

/* The library's version, "MAJOR.MINOR.PATCH"; a static string. */
const char *mc_guard_version(void);

#ifdef __cplusplus
}
#endif

#endif /* MCGUARD_H */
