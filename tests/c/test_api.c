/* C11 consumer of include/mcguard.h: two guards in one process, real
 * transfers checked with memcmp, and the error paths of every call. */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mcguard.h"

static int failures;

#define CHECK(cond)                                                       \
    do {                                                                  \
        if (!(cond)) {                                                    \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
            failures++;                                                   \
        }                                                                 \
    } while (0)

#define CHECK_STATUS(call, want, h, text)                                 \
    do {                                                                  \
        mc_status st_ = (call);                                           \
        char msg_[512];                                                   \
        mc_guard_last_error((h), msg_, sizeof msg_);                      \
        if (st_ != (want) || ((want) != MC_OK && !strstr(msg_, (text)))) { \
            fprintf(stderr, "%s:%d: %s -> %d (want %d), message \"%s\" (want \"%s\")\n", \
                    __FILE__, __LINE__, #call, st_, (want), msg_, (text)); \
            failures++;                                                   \
        }                                                                 \
    } while (0)

enum { BLOCKS = 600, BLOCK = 4096, SIZE = BLOCKS * BLOCK };

static int fault_warnings;

static void on_log(int32_t level, const char *message, void *ctx) {
    if (level == MC_LOG_WARN && strstr(message, "FAULT INJECTION ON") && ctx == &fault_warnings) fault_warnings++;
}

int main(void) {
    mc_guard_t sender = 0, receiver = 0;
    CHECK(strcmp(mc_guard_version(), MC_GUARD_VERSION_STRING) == 0);
    CHECK_STATUS(mc_guard_open("{\"verify\": \"tail\", \"connect_timeout_ms\": 300}", &sender), MC_OK, 0, "");
    CHECK_STATUS(mc_guard_open(NULL, &receiver), MC_OK, 0, "");
    CHECK(sender != 0 && receiver != 0 && sender != receiver);

    char endpoint[128];
    CHECK_STATUS(mc_guard_endpoint(receiver, endpoint, sizeof endpoint), MC_OK, receiver, "");
    CHECK(strchr(endpoint, ':') != NULL);

    unsigned char *src = malloc(SIZE), *dst = calloc(1, SIZE);
    for (size_t i = 0; i < SIZE; i++) src[i] = (unsigned char)(i * 131 + 7);
    CHECK_STATUS(mc_guard_register(sender, src, SIZE), MC_OK, sender, "");
    CHECK_STATUS(mc_guard_register(receiver, dst, SIZE), MC_OK, receiver, "");

    /* 600 descriptors: more than one max_batch chunk of 512. */
    uint64_t outside_range = (uint64_t)(uintptr_t)(dst + SIZE);
    uint64_t *s = malloc(BLOCKS * sizeof *s), *d = malloc(BLOCKS * sizeof *d), *l = malloc(BLOCKS * sizeof *l);
    for (size_t i = 0; i < BLOCKS; i++) {
        s[i] = (uint64_t)(uintptr_t)(src + i * BLOCK);
        d[i] = (uint64_t)(uintptr_t)(dst + (BLOCKS - 1 - i) * BLOCK); /* reversed order */
        l[i] = BLOCK;
    }
    mc_transfer_opts opts = {0};
    opts.struct_size = sizeof opts;
    opts.verify = MC_VERIFY_DEFAULT;
    CHECK_STATUS(mc_guard_transfer(sender, endpoint, s, d, l, BLOCKS, &opts), MC_OK, sender, "");
    CHECK(opts.transfer_id > 0);

    /* The receiver's regions, as Mooncake's get_first_buffer_address reads them. */
    size_t nregions = 99;
    CHECK_STATUS(mc_guard_peer_regions(sender, endpoint, NULL, NULL, 0, &nregions), MC_ERR_BUFFER_TOO_SMALL, sender,
                 "room for 0");
    CHECK(nregions == 1);
    uint64_t region_addr = 0, region_len = 0;
    CHECK_STATUS(mc_guard_peer_regions(sender, endpoint, &region_addr, &region_len, 1, &nregions), MC_OK, sender, "");
    CHECK(nregions == 1 && region_addr == (uint64_t)(uintptr_t)dst && region_len == SIZE);
    CHECK_STATUS(mc_guard_peer_regions(sender, endpoint, NULL, NULL, 1, &nregions), MC_ERR_INVALID_ARG, sender,
                 "NULL");
    CHECK_STATUS(mc_guard_peer_regions(sender, NULL, &region_addr, &region_len, 1, NULL), MC_ERR_INVALID_ARG, sender,
                 "session is NULL");

    /* Notifies: sent after the transfer, taken once by the receiver. */
    char notes[256];
    size_t notes_len = 0;
    CHECK_STATUS(mc_guard_notify(sender, endpoint, "req-7", "kv\0ready", 8), MC_OK, sender, "");
    CHECK_STATUS(mc_guard_notifies(receiver, notes, 8, &notes_len), MC_ERR_BUFFER_TOO_SMALL, receiver, "stay queued");
    CHECK_STATUS(mc_guard_notifies(receiver, notes, sizeof notes, &notes_len), MC_OK, receiver, "");
    CHECK(strcmp(notes, "[{\"name\":\"req-7\",\"msg\":\"kv\\u0000ready\"}]") == 0 && notes_len == strlen(notes));
    CHECK_STATUS(mc_guard_notifies(receiver, notes, sizeof notes, NULL), MC_OK, receiver, "");
    CHECK(strcmp(notes, "[]") == 0);
    CHECK_STATUS(mc_guard_notify(sender, endpoint, "req-8", NULL, 1), MC_ERR_INVALID_ARG, sender, "NULL");
    CHECK_STATUS(mc_guard_notify(sender, endpoint, "req-8", "\xff", 1), MC_ERR_INVALID_ARG, sender, "UTF-8");
    int same = 1;
    for (size_t i = 0; i < BLOCKS; i++)
        same &= memcmp(src + i * BLOCK, dst + (BLOCKS - 1 - i) * BLOCK, BLOCK) == 0;
    CHECK(same);
    uint64_t range_addr = d[0], range_len = BLOCK;
    CHECK_STATUS(mc_guard_sync(receiver, &range_addr, &range_len, 1, NULL), MC_OK, receiver, "");

    /* A quiesce, and a transfer into the quiesced range after it: taken
     * (the quiesce pushed its mark to the sender's connection before it
     * returned; the sender echoes it before its next writes). */
    CHECK_STATUS(mc_guard_quiesce(receiver, &range_addr, &range_len, 1), MC_OK, receiver, "");
    CHECK_STATUS(mc_guard_quiesce(receiver, &outside_range, &range_len, 1), MC_ERR_NOT_REGISTERED, receiver, "quiesce range 0");
    CHECK_STATUS(mc_guard_quiesce(receiver, NULL, NULL, 1), MC_ERR_INVALID_ARG, receiver, "NULL");
    CHECK_STATUS(mc_guard_cancel(sender, endpoint), MC_OK, sender, "");
    CHECK_STATUS(mc_guard_cancel(sender, NULL), MC_ERR_INVALID_ARG, sender, "NULL");
    /* Waiting for engine calls is for guards over an engine: over TCP the
     * abort state and the receiver's quiesce say it. */
    CHECK_STATUS(mc_guard_wait_engine_calls(sender, opts.transfer_id, 0), MC_ERR_INVALID_ARG, sender, "quiesce");
    CHECK_STATUS(mc_guard_quiesce_engine(sender, endpoint, &range_addr, &range_len, 1), MC_ERR_INVALID_ARG, sender,
                 "over an engine");
    CHECK_STATUS(mc_guard_quiesce_engine(sender, NULL, &range_addr, &range_len, 1), MC_ERR_INVALID_ARG, sender, "NULL");
    opts.deadline_ms = 10000;
    CHECK_STATUS(mc_guard_transfer(sender, endpoint, s, d, l, BLOCKS, &opts), MC_OK, sender, "");
    CHECK(opts.abort_state == MC_ABORT_NONE);
    /* A 0.2 caller's smaller opts struct is still taken. */
    opts.struct_size = (uint32_t)offsetof(mc_transfer_opts, deadline_ms);
    CHECK_STATUS(mc_guard_transfer(sender, endpoint, s, d, l, 1, &opts), MC_OK, sender, "");
    opts.struct_size = (uint32_t)offsetof(mc_transfer_opts, deadline_ms) + 4;
    CHECK_STATUS(mc_guard_transfer(sender, endpoint, s, d, l, 1, &opts), MC_ERR_INVALID_ARG, sender, "struct_size");
    opts.struct_size = sizeof opts;

    /* The log sink: the fault-injection warning reaches it, with ctx. */
    CHECK_STATUS(mc_guard_set_log(MC_LOG_WARN, on_log, &fault_warnings), MC_OK, 0, "");
    mc_guard_t faulty = 0;
    CHECK_STATUS(mc_guard_open("{\"inject\": \"lag\"}", &faulty), MC_OK, 0, "");
    CHECK(fault_warnings == 1);
    CHECK_STATUS(mc_guard_close(faulty), MC_OK, faulty, "");
    CHECK_STATUS(mc_guard_set_log(-1, NULL, NULL), MC_OK, 0, "");
    CHECK_STATUS(mc_guard_set_log(7, NULL, NULL), MC_ERR_INVALID_ARG, 0, "log level 7");

    /* A verified read: the receiver seals four of its blocks, the sender
     * reads them into a buffer of its own; a block reused after the seal
     * fails the read, naming it. */
    {
        enum { SEALED = 4 };
        unsigned char *into = calloc(1, SEALED * BLOCK);
        uint64_t local[SEALED], remote[SEALED], lens[SEALED];
        for (size_t i = 0; i < SEALED; i++) {
            local[i] = (uint64_t)(uintptr_t)(into + i * BLOCK);
            remote[i] = d[i];
            lens[i] = BLOCK;
        }
        CHECK_STATUS(mc_guard_register(sender, into, SEALED * BLOCK), MC_OK, sender, "");
        uint8_t seal[MC_GUARD_SEAL_SIZE(SEALED)], tiny_seal[8];
        size_t seal_len = 0;
        CHECK_STATUS(mc_guard_seal(receiver, remote, lens, SEALED, tiny_seal, sizeof tiny_seal, &seal_len),
                     MC_ERR_BUFFER_TOO_SMALL, receiver, "MC_GUARD_SEAL_SIZE");
        CHECK(seal_len > 0 && seal_len <= sizeof seal);
        CHECK_STATUS(mc_guard_seal(receiver, remote, lens, SEALED, seal, sizeof seal, &seal_len), MC_OK, receiver, "");
        CHECK_STATUS(mc_guard_read_sealed(sender, endpoint, local, remote, lens, SEALED, seal, seal_len, MC_VERIFY_DIGEST),
                     MC_OK, sender, "");
        int equal = 1;
        for (size_t i = 0; i < SEALED; i++) equal &= memcmp(into + i * BLOCK, (void *)(uintptr_t)d[i], BLOCK) == 0;
        CHECK(equal);
        uint8_t id[MC_GUARD_ID_SIZE];
        CHECK_STATUS(mc_guard_id(receiver, id, sizeof id), MC_OK, receiver, "");
        CHECK_STATUS(mc_guard_id(receiver, id, 4), MC_ERR_BUFFER_TOO_SMALL, receiver, "MC_GUARD_ID_SIZE");
        CHECK_STATUS(mc_guard_check_seal(sender, local, NULL, lens, SEALED, seal, seal_len, MC_VERIFY_TAIL, id), MC_OK,
                     sender, "");
        ((unsigned char *)(uintptr_t)d[2])[BLOCK - 1] ^= 0xff; /* block 2 reused */
        CHECK_STATUS(mc_guard_read_sealed(sender, endpoint, local, remote, lens, SEALED, seal, seal_len, MC_VERIFY_TAIL),
                     MC_ERR_VERIFY, sender, "[2]");
        ((unsigned char *)(uintptr_t)d[2])[BLOCK - 1] ^= 0xff;
        CHECK_STATUS(mc_guard_read_sealed(sender, endpoint, local, remote, lens, SEALED, seal, seal_len - 1, MC_VERIFY_DIGEST),
                     MC_ERR_SEAL, sender, "truncated");
        CHECK_STATUS(mc_guard_read_sealed(sender, endpoint, local, remote, lens, SEALED - 1, seal, seal_len, MC_VERIFY_DIGEST),
                     MC_OK, sender, ""); /* some of the sealed ranges, matched by address */
        CHECK_STATUS(mc_guard_check_seal(sender, local, NULL, lens, SEALED - 1, seal, seal_len, MC_VERIFY_DIGEST, NULL),
                     MC_ERR_SEAL, sender, "named address");
        CHECK_STATUS(mc_guard_read_sealed(sender, endpoint, local, remote, lens, SEALED, NULL, seal_len, MC_VERIFY_DIGEST),
                     MC_ERR_INVALID_ARG, sender, "NULL");
        CHECK_STATUS(mc_guard_read_sealed(sender, endpoint, local, remote, lens, SEALED, seal, seal_len, MC_VERIFY_SAMPLE),
                     MC_ERR_INVALID_ARG, sender, "MC_VERIFY_DIGEST or MC_VERIFY_TAIL");
        CHECK_STATUS(mc_guard_check_seal(sender, NULL, NULL, lens, SEALED, seal, seal_len, MC_VERIFY_DIGEST, NULL),
                     MC_ERR_INVALID_ARG, sender, "NULL");
        CHECK_STATUS(mc_guard_seal(receiver, remote, lens, 0, seal, sizeof seal, NULL), MC_ERR_INVALID_ARG, receiver,
                     "at least one range");
        /* Published under a request's name and fetched by the reader. */
        CHECK_STATUS(mc_guard_publish(receiver, "req-9", remote, lens, SEALED), MC_OK, receiver, "");
        uint8_t fetched[MC_GUARD_SEAL_SIZE(SEALED)];
        size_t fetched_len = 0;
        CHECK_STATUS(mc_guard_fetch_seal(sender, endpoint, "req-9", 2000, fetched, sizeof fetched, &fetched_len), MC_OK,
                     sender, "");
        CHECK_STATUS(mc_guard_read_sealed(sender, endpoint, local, remote, lens, SEALED, fetched, fetched_len,
                                          MC_VERIFY_DEFAULT), MC_OK, sender, "");
        CHECK_STATUS(mc_guard_fetch_seal(sender, endpoint, "req-9", 2000, fetched, 4, &fetched_len),
                     MC_ERR_BUFFER_TOO_SMALL, sender, "buffer holds 4");
        CHECK_STATUS(mc_guard_withdraw(receiver, "req-9"), MC_OK, receiver, "");
        CHECK_STATUS(mc_guard_withdraw(receiver, "req-9"), MC_ERR_INVALID_ARG, receiver, "no seal published");
        CHECK_STATUS(mc_guard_fetch_seal(sender, endpoint, "req-9", 50, fetched, sizeof fetched, NULL), MC_ERR_TIMEOUT,
                     sender, "published no seal");
        CHECK_STATUS(mc_guard_publish(receiver, NULL, remote, lens, SEALED), MC_ERR_INVALID_ARG, receiver, "NULL");
        CHECK_STATUS(mc_guard_unregister(sender, into), MC_OK, sender, "");
        free(into);
    }

    /* Error paths: each a named status and a message. */
    mc_guard_t bogus = 0;
    CHECK_STATUS(mc_guard_open("{\"max_batch\": -3}", &bogus), MC_ERR_CONFIG, 0, "max_batch");
    CHECK_STATUS(mc_guard_open(NULL, NULL), MC_ERR_INVALID_ARG, 0, "NULL");
    CHECK_STATUS(mc_guard_transfer(sender, NULL, s, d, l, 1, NULL), MC_ERR_INVALID_ARG, sender, "session is NULL");
    CHECK_STATUS(mc_guard_transfer(sender, endpoint, NULL, d, l, 1, NULL), MC_ERR_INVALID_ARG, sender, "NULL");
    CHECK_STATUS(mc_guard_transfer(sender, endpoint, s, d, l, 0, NULL), MC_ERR_INVALID_ARG, sender, "n is 0");
    CHECK_STATUS(mc_guard_transfer(sender, endpoint, s, d, l, (size_t)-1, NULL), MC_ERR_INVALID_ARG, sender, "MAX_DESCRIPTORS");
    uint64_t zero = 0, outside = (uint64_t)(uintptr_t)(src + SIZE);
    CHECK_STATUS(mc_guard_transfer(sender, endpoint, s, d, &zero, 1, NULL), MC_ERR_INVALID_ARG, sender, "length 0");
    CHECK_STATUS(mc_guard_transfer(sender, endpoint, &outside, d, l, 1, NULL), MC_ERR_NOT_REGISTERED, sender, "local side");
    CHECK_STATUS(mc_guard_transfer(sender, endpoint, s, &outside, l, 1, NULL), MC_ERR_NOT_REGISTERED, sender, "remote side");
    CHECK_STATUS(mc_guard_transfer(sender, "nowhere", s, d, l, 1, NULL), MC_ERR_INVALID_ARG, sender, "host:port");
    CHECK_STATUS(mc_guard_transfer(sender, "127.0.0.1:1", s, d, l, 1, NULL), MC_ERR_PEER, sender, "connection refused");
    CHECK_STATUS(mc_guard_transfer(sender, "127.0.0.1:99999", s, d, l, 1, NULL), MC_ERR_INVALID_ARG, sender, "not \"host:port\"");
    CHECK_STATUS(mc_guard_register(sender, NULL, 10), MC_ERR_INVALID_ARG, sender, "null");
    /* Host memory named as GPU memory: no driver here, or not device memory. */
    CHECK_STATUS(mc_guard_register_device(sender, dst, 4096), MC_ERR_DEVICE, sender, "device");
    CHECK_STATUS(mc_guard_unregister(sender, dst), MC_ERR_NOT_REGISTERED, sender, "no region");
    CHECK_STATUS(mc_guard_alloc(sender, 4096, NULL), MC_ERR_INVALID_ARG, sender, "out is NULL");
    void *allocated = NULL;
    CHECK_STATUS(mc_guard_alloc(sender, 0, &allocated), MC_ERR_INVALID_ARG, sender, "allocation of 0 bytes");
    CHECK_STATUS(mc_guard_alloc(sender, 4096, &allocated), MC_OK, sender, "");
    CHECK(allocated != NULL);
    CHECK_STATUS(mc_guard_free(sender, dst), MC_ERR_INVALID_ARG, sender, "not an allocation");
    CHECK_STATUS(mc_guard_free(sender, allocated), MC_OK, sender, "");
    char tiny[4];
    CHECK_STATUS(mc_guard_endpoint(receiver, tiny, sizeof tiny), MC_ERR_BUFFER_TOO_SMALL, receiver, "needed");
    size_t needed = 0;
    CHECK_STATUS(mc_guard_stats(sender, tiny, sizeof tiny, &needed), MC_ERR_BUFFER_TOO_SMALL, sender, "needed");
    char *stats = malloc(needed + 1);
    CHECK_STATUS(mc_guard_stats(sender, stats, needed + 1, NULL), MC_OK, sender, "");
    CHECK(strstr(stats, "\"ok\":3") != NULL);
    free(stats);
    CHECK_STATUS(mc_guard_stats(424242, tiny, sizeof tiny, NULL), MC_ERR_BAD_HANDLE, 424242, "not a guard handle");

    /* The sender's cached region table still lists dst: the target itself refuses. */
    CHECK_STATUS(mc_guard_unregister(receiver, dst), MC_OK, receiver, "");
    CHECK_STATUS(mc_guard_transfer(sender, endpoint, s, d, l, 1, NULL), MC_ERR_NOT_REGISTERED, sender, "target refused descriptor 0");
    CHECK_STATUS(mc_guard_close(receiver), MC_OK, receiver, "");
    CHECK_STATUS(mc_guard_close(receiver), MC_ERR_BAD_HANDLE, receiver, "closed");
    CHECK_STATUS(mc_guard_transfer(receiver, endpoint, s, d, l, 1, NULL), MC_ERR_BAD_HANDLE, receiver, "closed");
    CHECK_STATUS(mc_guard_close(sender), MC_OK, sender, "");

    free(s); free(d); free(l); free(src); free(dst);
    if (failures) {
        fprintf(stderr, "%d check(s) failed\n", failures);
        return 1;
    }
    printf("c api: all checks passed\n");
    return 0;
}
