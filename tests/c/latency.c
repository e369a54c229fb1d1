/* Small-transfer latency through the C ABI alone (no Python, no ctypes):
 * a receiving guard in a child process (this program run with "serve"),
 * the sender here, 1 x 4 KiB transfers timed one by one, medians and p90
 * for each verification mode, on one host (the sender writes into the
 * receiver itself: into memory the receiver registered, with
 * process_vm_writev, and into memory from mc_guard_alloc, mapped, with
 * memcpy) and with same_host off (the bytes through the loopback socket).
 * The receiver hashes the destination after each configuration, so every
 * row moved the right bytes.
 *
 *   latency [ITERATIONS]     (default 20000)
 */
#include "mcguard.h"

#include <inttypes.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern char **environ;

enum { SIZE = 4096 };

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static uint64_t fnv(const unsigned char *p, size_t n) {
    uint64_t h = 1469598103934665603ULL;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ULL;
    return h;
}

/* The receiver: register a region and allocate one, say where they are,
 * answer "hash N" lines (N: 0 the registered one, 1 the allocated one). */
static int serve(void) {
    mc_guard_t g;
    static unsigned char registered[SIZE];
    void *allocated = NULL;
    if (mc_guard_open("{}", &g) != MC_OK || mc_guard_register(g, registered, SIZE) != MC_OK ||
        mc_guard_alloc(g, SIZE, &allocated) != MC_OK)
        return 1;
    unsigned char *dst[2] = {registered, allocated};
    char ep[128];
    if (mc_guard_endpoint(g, ep, sizeof ep) != MC_OK) return 1;
    printf("%s %" PRIu64 " %" PRIu64 "\n", ep, (uint64_t)(uintptr_t)dst[0], (uint64_t)(uintptr_t)dst[1]);
    fflush(stdout);
    char line[64];
    while (fgets(line, sizeof line, stdin) && strncmp(line, "hash ", 5) == 0) {
        int which = line[5] == '1';
        uint64_t a = (uint64_t)(uintptr_t)dst[which], n = SIZE;
        if (mc_guard_sync(g, &a, &n, 1, NULL) != MC_OK) return 1;
        printf("%016" PRIx64 "\n", fnv(dst[which], SIZE));
        fflush(stdout);
    }
    mc_guard_close(g);
    return 0;
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "serve") == 0) return serve();
    int iters = argc > 1 ? atoi(argv[1]) : 20000;
    if (iters < 100) iters = 100;

    int to_child[2], from_child[2];
    if (pipe(to_child) || pipe(from_child)) return 1;
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, to_child[0], 0);
    posix_spawn_file_actions_adddup2(&fa, from_child[1], 1);
    posix_spawn_file_actions_addclose(&fa, to_child[1]);
    posix_spawn_file_actions_addclose(&fa, from_child[0]);
    char *child_argv[] = {argv[0], "serve", NULL};
    pid_t pid;
    if (posix_spawn(&pid, "/proc/self/exe", &fa, NULL, child_argv, environ) != 0) return 1;
    close(to_child[0]);
    close(from_child[1]);
    FILE *in = fdopen(from_child[0], "r"), *out = fdopen(to_child[1], "w");
    char ep[128];
    uint64_t dsts[2];
    if (fscanf(in, "%127s %" SCNu64 " %" SCNu64, ep, &dsts[0], &dsts[1]) != 3) {
        fprintf(stderr, "the receiver did not start\n");
        return 1;
    }

    static unsigned char src[SIZE];
    double *t = malloc(sizeof(double) * iters);
    const char *modes[] = {"off", "tail", "sample", "digest"};
    /* same_host, and which destination: registered, or mc_guard_alloc's */
    const char *planes[] = {"auto", "auto", "off"};
    const int which[] = {1, 0, 0};
    printf("%-8s %-32s %10s %10s\n", "verify", "path", "median us", "p90 us");
    int failed = 0;
    for (int p = 0; p < 3; p++) {
        uint64_t dst = dsts[which[p]];
        for (int m = 0; m < 4; m++) {
            char cfg[160];
            snprintf(cfg, sizeof cfg, "{\"verify\": \"%s\", \"same_host\": \"%s\"}", modes[m], planes[p]);
            mc_guard_t g;
            if (mc_guard_open(cfg, &g) != MC_OK || mc_guard_register(g, src, SIZE) != MC_OK) return 1;
            uint64_t s = (uint64_t)(uintptr_t)src, len = SIZE;
            for (int i = 0; i < iters + 500; i++) {
                src[i % SIZE] = (unsigned char)(i * 31 + m); /* new bytes each time */
                double a = now_us();
                mc_status st = mc_guard_transfer(g, ep, &s, &dst, &len, 1, NULL);
                double b = now_us();
                if (st != MC_OK) {
                    char msg[512];
                    mc_guard_last_error(g, msg, sizeof msg);
                    fprintf(stderr, "transfer failed: %s\n", msg);
                    return 1;
                }
                if (i >= 500) t[i - 500] = b - a;
            }
            fprintf(out, "hash %d\n", which[p]);
            fflush(out);
            char hex[32];
            if (fscanf(in, "%31s", hex) != 1) return 1;
            int same = strtoull(hex, NULL, 16) == fnv(src, SIZE);
            failed |= !same;
            char stats[4096];
            size_t needed = 0;
            if (mc_guard_stats(g, stats, sizeof stats, &needed) != MC_OK) return 1;
            int pushed = strstr(stats, "\"same_host_pushed_bytes\":0,") == NULL;
            int mapped = strstr(stats, "\"same_host_mapped_bytes\":0,") == NULL;
            qsort(t, iters, sizeof(double), cmp);
            printf("%-8s %-32s %10.2f %10.2f%s\n", modes[m],
                   mapped   ? "same host, mapped (memcpy)"
                   : pushed ? "same host (process_vm_writev)"
                            : "socket",
                   t[iters / 2], t[iters * 9 / 10],
                   same ? "" : "  WRONG BYTES");
            fflush(stdout);
            mc_guard_close(g);
        }
    }
    fclose(out);
    waitpid(pid, NULL, 0);
    printf("%d transfers per row; the receiver hashed the destination after each row%s\n", iters,
           failed ? ": SOME DID NOT MATCH" : " and it matched");
    return failed;
}
