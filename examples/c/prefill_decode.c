/* Prefill and decode in two processes: the decode side registers its KV
 * region and tells the prefill side its endpoint and the region's address;
 * the prefill side writes the blocks in digest mode and forwards the
 * transfer id (its own "done" message, as a serving engine sends one); the
 * decode side syncs that id, which compares the digests, and only then
 * reads the blocks. run.sh runs the two.
 *
 *   prefill_decode decode            prints "ENDPOINT ADDRESS", reads the id
 *   prefill_decode prefill EP ADDR   prints the transfer id */
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mcguard.h"

enum { BLOCKS = 64, BLOCK = 64 << 10 };

static int fail(mc_guard_t g, const char *what, mc_status st) {
    char msg[512];
    mc_guard_last_error(g, msg, sizeof msg);
    fprintf(stderr, "prefill_decode: %s: status %d: %s\n", what, st, msg);
    return 1;
}

static unsigned char pattern(size_t i) { return (unsigned char)(i * 131 + 7); }

static int decode(void) {
    mc_guard_t g;
    mc_status st = mc_guard_open(NULL, &g);
    if (st != MC_OK) return fail(0, "open", st);
    unsigned char *kv = calloc(BLOCKS, BLOCK);
    if ((st = mc_guard_register(g, kv, (size_t)BLOCKS * BLOCK)) != MC_OK) return fail(g, "register", st);
    char endpoint[128];
    if ((st = mc_guard_endpoint(g, endpoint, sizeof endpoint)) != MC_OK) return fail(g, "endpoint", st);
    printf("%s %" PRIu64 "\n", endpoint, (uint64_t)(uintptr_t)kv);
    fflush(stdout);
    uint64_t id;
    if (scanf("%" SCNu64, &id) != 1) return fail(g, "reading the transfer id", -1);
    /* The bytes may be read only after the sync: it waits for the notice
     * and compares the sender's digests with the destination's. */
    if ((st = mc_guard_sync_transfers(g, &id, 1, NULL)) != MC_OK) return fail(g, "sync_transfers", st);
    for (size_t i = 0; i < (size_t)BLOCKS * BLOCK; i++) {
        if (kv[i] != pattern(i)) {
            fprintf(stderr, "prefill_decode: byte %zu differs after a successful sync\n", i);
            return 1;
        }
    }
    printf("decode: %d blocks verified\n", BLOCKS);
    mc_guard_close(g);
    return 0;
}

static int prefill(const char *endpoint, uint64_t remote) {
    mc_guard_t g;
    mc_status st = mc_guard_open("{\"verify\": \"digest\"}", &g);
    if (st != MC_OK) return fail(0, "open", st);
    unsigned char *kv = malloc((size_t)BLOCKS * BLOCK);
    for (size_t i = 0; i < (size_t)BLOCKS * BLOCK; i++) kv[i] = pattern(i);
    if ((st = mc_guard_register(g, kv, (size_t)BLOCKS * BLOCK)) != MC_OK) return fail(g, "register", st);
    uint64_t src[BLOCKS], dst[BLOCKS], len[BLOCKS];
    for (size_t i = 0; i < BLOCKS; i++) {
        src[i] = (uint64_t)(uintptr_t)(kv + i * BLOCK);
        dst[i] = remote + i * BLOCK;
        len[i] = BLOCK;
    }
    mc_transfer_opts opts = {0};
    opts.struct_size = sizeof opts;
    opts.verify = MC_VERIFY_DEFAULT;
    if ((st = mc_guard_transfer(g, endpoint, src, dst, len, BLOCKS, &opts)) != MC_OK) return fail(g, "transfer", st);
    printf("%" PRIu64 "\n", opts.transfer_id);
    mc_guard_close(g);
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 2 && strcmp(argv[1], "decode") == 0) return decode();
    if (argc == 4 && strcmp(argv[1], "prefill") == 0) return prefill(argv[2], strtoull(argv[3], NULL, 10));
    fprintf(stderr, "usage: prefill_decode decode | prefill_decode prefill ENDPOINT ADDRESS\n");
    return 2;
}
