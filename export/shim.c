// The public entry points. Each checks for a forked child first, in C:
// entering the Go runtime in a child of fork() hangs (golang/go#15538), so
// a child gets MC_ERR_FORKED without ever reaching Go. Then it keeps a busy
// caller's scheduler slot (mcg_keep_slot, below) and calls the Go
// export of the same job; that this file compiles against both mcguard.h
// and the cgo-generated _cgo_export.h is what keeps the two in agreement.
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "mcguard.h"
#include "_cgo_export.h"

static pid_t mcg_pid;

__attribute__((constructor)) static void mcg_record_pid(void) { mcg_pid = getpid(); }

static int mcg_forked(void) { return getpid() != mcg_pid; }

// A thread that calls in again and again should keep the Go scheduler
// slot (P) it holds between calls. The runtime's monitor thread takes a
// slot away from a thread outside Go once the slot has not run the
// scheduler for 10 ms, and a call into Go from C never runs it: so the
// monitor takes the caller's slot in every pause, then sleeps, and the
// caller's next call wakes it (a futex wake, and the monitor's thread
// taking a CPU from the process's other threads, a transfer engine's
// among them: docs/PERFORMANCE.md). A thread whose last call was under
// MCG_YIELD_NS ago therefore runs the scheduler once per MCG_YIELD_NS
// (mcgYield): its slot stays fresh, and the monitor leaves it alone and
// backs off. The monitor counts 10 ms from when it sees a slot run the
// scheduler, so 8 ms between yields keeps the slot fresh wherever the
// calls are under 2 ms apart. A thread that calls rarely never yields.
#define MCG_YIELD_NS 8000000LL

static __thread int64_t mcg_last_call_ns, mcg_last_yield_ns;

static void mcg_keep_slot(void) {
    struct timespec ts;
    if (clock_gettime(CLOCK_MONOTONIC, &ts) != 0) return;
    int64_t now = (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
    int busy = mcg_last_call_ns != 0 && now - mcg_last_call_ns < MCG_YIELD_NS;
    mcg_last_call_ns = now;
    if (busy && now - mcg_last_yield_ns >= MCG_YIELD_NS) {
        mcg_last_yield_ns = now;
        mcgYield();
    }
}

// Every entry point starts here: a forked child stops (nonzero), any other
// caller keeps its scheduler slot fresh.
static int mcg_enter(void) {
    if (mcg_forked()) return 1;
    mcg_keep_slot();
    return 0;
}

static const char mcg_forked_msg[] =
    "mcguard: this process is a child of fork(); the library cannot be used "
    "after fork (the Go runtime would hang). Open a guard in a spawned process.";

const char *mcg_getenv(const char *name) { return getenv(name); }

void mcg_call_log(mc_log_fn fn, int32_t level, const char *message, void *ctx) { fn(level, message, ctx); }

mc_status mcg_call_batch(mc_transport_batch_fn fn, void *ctx, const char *session, const uint64_t *local,
                         const uint64_t *remote, const uint64_t *len, size_t n, char *msg, size_t msg_len) {
    return fn(ctx, session, local, remote, len, n, msg, msg_len);
}

mc_status mcg_call_register(mc_transport_register_fn fn, void *ctx, uint64_t addr, uint64_t len, char *msg,
                            size_t msg_len) {
    return fn(ctx, addr, len, msg, msg_len);
}

mc_status mcg_call_unregister(mc_transport_unregister_fn fn, void *ctx, uint64_t addr, char *msg, size_t msg_len) {
    return fn(ctx, addr, msg, msg_len);
}

mc_status mcg_call_fence(mc_transport_fence_fn fn, void *ctx, const char *session, char *msg, size_t msg_len) {
    return fn(ctx, session, msg, msg_len);
}

mc_status mc_guard_open_with_transport(const char *config_json, const mc_transport_ops *ops, void *ctx,
                                       mc_guard_t *out) {
    if (mcg_enter()) return MC_ERR_FORKED;
    return mcgOpenWithTransport((char *)config_json, (mc_transport_ops *)ops, ctx, out);
}

mc_status mc_guard_set_peer_guard(mc_guard_t g, const char *session, const char *endpoint) {
    if (mcg_enter()) return MC_ERR_FORKED;
    return mcgSetPeerGuard(g, (char *)session, (char *)endpoint);
}

mc_status mc_guard_set_log(int32_t level, mc_log_fn fn, void *ctx) {
    if (mcg_enter()) return MC_ERR_FORKED;
    return mcgSetLog(level, fn, ctx);
}

mc_status mc_guard_open(const char *config_json, mc_guard_t *out) {
    if (mcg_enter()) return MC_ERR_FORKED;
    return mcgOpen((char *)config_json, out);
}

mc_status mc_guard_close(mc_guard_t g) {
    if (mcg_enter()) return MC_ERR_FORKED;
    return mcgClose(g);
}

mc_status mc_guard_register(mc_guard_t g, void *addr, size_t len) {
    if (mcg_enter()) return MC_ERR_FORKED;
    return mcgRegister(g, addr, len);
}

mc_status mc_guard_register_device(mc_guard_t g, void *addr, size_t len) {
    if (mcg_enter()) return MC_ERR_FORKED;
    return mcgRegisterDevice(g, addr, len);
}

mc_status mc_guard_alloc(mc_guard_t g, size_t len, void **out) {
    if (mcg_enter()) return MC_ERR_FORKED;
    return mcgAlloc(g, len, out);
}

mc_status mc_guard_free(mc_guard_t g, void *addr) {
    if (mcg_enter()) return MC_ERR_FORKED;
    return mcgFree(g, addr);
}

mc_status mc_guard_unregister(mc_guard_t g, void *addr) {
    if (mcg_enter()) return MC_ERR_FORKED;
    return mcgUnregister(g, addr);
}

mc_status mc_guard_transfer(mc_guard_t g, const char *session, const uint64_t *src,
                            const uint64_t *dst, const uint64_t *len, size_t n,
                            mc_transfer_opts *opts) {
    if (mcg_enter()) return MC_ERR_FORKED;
    return mcgTransfer(g, (char *)session, (uint64_t *)src, (uint64_t *)dst, (uint64_t *)len, n, opts);
}

mc_status mc_guard_read(mc_guard_t g, const char *session, const uint64_t *local,
                        const uint64_t *remote, const uint64_t *len, size_t n) {
    if (mcg_enter()) return MC_ERR_FORKED;
    return mcgRead(g, (char *)session, (uint64_t *)local, (uint64_t *)remote, (uint64_t *)len, n);
}

mc_status mc_guard_seal(mc_guard_t g, const uint64_t *addr, const uint64_t *len, size_t n, uint8_t *seal,
                        size_t cap, size_t *seal_len) {
    if (mcg_enter()) return MC_ERR_FORKED;
    return mcgSeal(g, (uint64_t *)addr, (uint64_t *)len, n, seal, cap, seal_len);
}

mc_status mc_guard_read_sealed(mc_guard_t g, const char *session, const uint64_t *local,
                               const uint64_t *remote, const uint64_t *len, size_t n, const uint8_t *seal,
                               size_t seal_len, int32_t mode) {
    if (mcg_enter()) return MC_ERR_FORKED;
    return mcgReadSealed(g, (char *)session, (uint64_t *)local, (uint64_t *)remote, (uint64_t *)len, n,
                         (uint8_t *)seal, seal_len, mode);
}

mc_status mc_guard_check_seal(mc_guard_t g, const uint64_t *local, const uint64_t *remote, const uint64_t *len,
                              size_t n, const uint8_t *seal, size_t seal_len, int32_t mode,
                              const uint8_t *producer) {
    if (mcg_enter()) return MC_ERR_FORKED;
    return mcgCheckSeal(g, (uint64_t *)local, (uint64_t *)remote, (uint64_t *)len, n, (uint8_t *)seal, seal_len,
                        mode, (uint8_t *)producer);
}

mc_status mc_guard_publish(mc_guard_t g, const char *name, const uint64_t *addr, const uint64_t *len, size_t n) {
    if (mcg_enter()) return MC_ERR_FORKED;
    return mcgPublish(g, (char *)name, (uint64_t *)addr, (uint64_t *)len, n);
}

mc_status mc_guard_withdraw(mc_guard_t g, const char *name) {
    if (mcg_enter()) return MC_ERR_FORKED;
    return mcgWithdraw(g, (char *)name);
}

mc_status mc_guard_fetch_seal(mc_guard_t g, const char *session, const char *name, uint64_t timeout_ms,
                              uint8_t *seal, size_t cap, size_t *seal_len) {
    if (mcg_enter()) return MC_ERR_FORKED;
    return mcgFetchSeal(g, (char *)session, (char *)name, timeout_ms, seal, cap, seal_len);
}

mc_status mc_guard_id(mc_guard_t g, uint8_t *id, size_t cap) {
    if (mcg_enter()) return MC_ERR_FORKED;
    return mcgGuardID(g, id, cap);
}

mc_status mc_guard_sync(mc_guard_t g, const uint64_t *addr, const uint64_t *len, size_t n,
                        const mc_sync_opts *opts) {
    if (mcg_enter()) return MC_ERR_FORKED;
    return mcgSync(g, (uint64_t *)addr, (uint64_t *)len, n, (mc_sync_opts *)opts);
}

mc_status mc_guard_sync_transfers(mc_guard_t g, const uint64_t *transfer_ids, size_t n,
                                  const mc_sync_opts *opts) {
    if (mcg_enter()) return MC_ERR_FORKED;
    return mcgSyncTransfers(g, (uint64_t *)transfer_ids, n, (mc_sync_opts *)opts);
}

mc_status mc_guard_cancel(mc_guard_t g, const char *session) {
    if (mcg_enter()) return MC_ERR_FORKED;
    return mcgCancel(g, (char *)session);
}

mc_status mc_guard_wait_engine_calls(mc_guard_t g, uint64_t transfer_id, uint64_t timeout_ms) {
    if (mcg_enter()) return MC_ERR_FORKED;
    return mcgWaitEngineCalls(g, transfer_id, timeout_ms);
}

mc_status mc_guard_quiesce_engine(mc_guard_t g, const char *session, const uint64_t *addr, const uint64_t *len,
                                  size_t n) {
    if (mcg_enter()) return MC_ERR_FORKED;
    return mcgQuiesceEngine(g, (char *)session, (uint64_t *)addr, (uint64_t *)len, n);
}

mc_status mc_guard_quiesce(mc_guard_t g, const uint64_t *addr, const uint64_t *len, size_t n) {
    if (mcg_enter()) return MC_ERR_FORKED;
    return mcgQuiesce(g, (uint64_t *)addr, (uint64_t *)len, n);
}

mc_status mc_guard_endpoint(mc_guard_t g, char *buf, size_t len) {
    if (mcg_enter()) return MC_ERR_FORKED;
    return mcgEndpoint(g, buf, len);
}

mc_status mc_guard_stats(mc_guard_t g, char *buf, size_t len, size_t *needed) {
    if (mcg_enter()) return MC_ERR_FORKED;
    return mcgStats(g, buf, len, needed);
}

mc_status mc_guard_metrics(mc_guard_t g, char *buf, size_t len, size_t *needed) {
    if (mcg_enter()) return MC_ERR_FORKED;
    return mcgMetrics(g, buf, len, needed);
}

size_t mc_guard_last_error(mc_guard_t g, char *buf, size_t len) {
    if (mcg_forked()) {
        size_t n = sizeof mcg_forked_msg - 1;
        if (buf && len > 0) {
            size_t k = n < len - 1 ? n : len - 1;
            memcpy(buf, mcg_forked_msg, k);
            buf[k] = '\0';
        }
        return n;
    }
    return mcgLastError(g, buf, len);
}

const char *mc_guard_version(void) { return MC_GUARD_VERSION_STRING; }

mc_status mc_guard_peer_regions(mc_guard_t g, const char *session, uint64_t *addr, uint64_t *len, size_t cap,
                                size_t *n) {
    if (mcg_enter()) return MC_ERR_FORKED;
    return mcgPeerRegions(g, (char *)session, addr, len, cap, n);
}

mc_status mc_guard_notify(mc_guard_t g, const char *session, const char *name, const char *msg, size_t msg_len) {
    if (mcg_enter()) return MC_ERR_FORKED;
    return mcgNotify(g, (char *)session, (char *)name, (char *)msg, msg_len);
}

mc_status mc_guard_notifies(mc_guard_t g, char *buf, size_t len, size_t *needed) {
    if (mcg_enter()) return MC_ERR_FORKED;
    return mcgNotifies(g, buf, len, needed);
}
