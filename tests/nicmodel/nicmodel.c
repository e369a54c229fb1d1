/* A software model of an RDMA NIC behind the libibverbs API, for tests on
 * machines without one. It exports the entry points mcguard's loader asks
 * for, so the real transport code runs unchanged on it, and keeps the
 * semantics that matter:
 *  - a WRITE completes when the remote "NIC" has accepted it, before its
 *    bytes are visible in the remote memory (they land up to
 *    MCG_NIC_LAG_US later: posted writes);
 *  - writes on one QP become visible in order; different QPs have no
 *    mutual order (each has its own delays);
 *  - a READ on a QP is answered only after that QP's earlier writes are
 *    visible (a READ flushes them, as on PCIe);
 *  - accesses are checked against the remote MR (rkey and bounds): a bad
 *    one completes in error (IBV_WC_REM_ACCESS_ERR) and moves the QP to
 *    the error state; MCG_NIC_FAIL_WR=n fails the n-th WRITE the same way;
 *  - the IBTA FLUSH verb, through the extended QP API: like a READ, it is
 *    answered once the QP's earlier writes are visible, and it needs an MR
 *    registered for it. MCG_NIC_NO_FLUSH=1 makes a device without it, and
 *    then an extended QP asking for it is refused, as providers do;
 *  - GPU memory, with the CUDA model (tests/cudamodel) loaded in the same
 *    process: ibv_reg_dmabuf_mr takes its dmabuf export, and a plain
 *    ibv_reg_mr of device memory fails with EFAULT unless MCG_NIC_PEERMEM=1
 *    (nvidia-peermem loaded). WRITEs into GPU memory land as GPUDirect
 *    writes (visible to kernels after a flush); a READ or FLUSH of GPU
 *    memory first flushes them (a read orders earlier posted writes: the
 *    NCCL GDR flush), so read-backs see the bytes;
 *  - deregistering an MR waits for the accepted writes into it to become
 *    visible (a NIC stops its DMA into a region before it lets it go);
 *  - MCG_NIC_STALL_READS=1 makes the remote NIC never answer READs and
 *    FLUSHes (a link that went quiet): what waits on them must be
 *    cancellable.
 * The fabric between processes is a Unix socket per process (abstract
 * name "mcgnic-<pid>"); a GID carries the pid. One device, one port. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <link.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "../../core/transport/rdma/verbs/flush_abi.h"

/* verbs.h wraps these two in macros for its inline fast paths; the model
 * defines the exported functions themselves. */
#undef ibv_query_port
#undef ibv_reg_mr

enum { M_WRITE = 1, M_READ = 2, M_ACK = 3, M_NAK = 4, M_READRESP = 5, M_HELLO = 6, M_FLUSH = 7, M_FLUSHRESP = 8 };

struct msg {
    uint32_t op, rkey, len, qpn;
    uint64_t wr_id, raddr;
};

struct mr_entry {
    struct ibv_mr mr;
    int access;
    int device; /* GPU memory of the CUDA model */
    struct mr_entry *next;
};

struct pending_read { /* a READ waiting for its response */
    uint64_t wr_id;
    struct ibv_sge sge[4];
    int nsge;
    int signaled;
    struct pending_read *next;
};

struct flush_wr { /* a FLUSH between wr_start and wr_complete */
    uint64_t wr_id, raddr, len;
    uint32_t rkey;
    int signaled;
};

struct mqp {
    union { /* an extended QP begins with the plain one */
        struct ibv_qp qp;
        struct ibv_qp_ex qpx;
        char qpx_with_flush[MCG_WR_FLUSH_OFFSET + sizeof(mcg_wr_flush_fn)];
    };
    int extended; /* made by create_qp_ex: ibv_qp_to_qp_ex answers */
    struct flush_wr batch[256];
    int nbatch, overflow;
    int fd; /* connection to the remote NIC, once RTR */
    pthread_t reader;
    int sq_sig_all;
    pthread_mutex_t mu;
    struct pending_read *reads;
};

struct wc_node {
    struct ibv_wc wc;
    struct wc_node *next;
};

struct mcq {
    struct ibv_cq cq;
    pthread_mutex_t mu;
    struct wc_node *head, *tail;
};

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static struct mr_entry *g_mrs;
static uint32_t g_next_key = 0x100, g_next_qpn = 0x10;
static int g_listening, g_writes, g_fail_wr, g_no_flush, g_peermem, g_stall_reads;
static long g_lag_us;
static struct ibv_device g_dev;
static struct ibv_device *g_list[2];

static long env_long(const char *name) {
    const char *v = getenv(name);
    return v ? atol(v) : 0;
}

static int read_full(int fd, void *p, size_t n) {
    char *b = p;
    while (n) {
        ssize_t k = read(fd, b, n);
        if (k <= 0) return -1;
        b += k;
        n -= (size_t)k;
    }
    return 0;
}

static int write_full(int fd, const void *p, size_t n) {
    const char *b = p;
    while (n) {
        ssize_t k = send(fd, b, n, MSG_NOSIGNAL); /* a peer gone is an error, not a signal */
        if (k <= 0) return -1;
        b += k;
        n -= (size_t)k;
    }
    return 0;
}

static void sock_name(struct sockaddr_un *a, socklen_t *len, int pid) {
    memset(a, 0, sizeof *a);
    a->sun_family = AF_UNIX;
    int n = snprintf(a->sun_path + 1, sizeof a->sun_path - 1, "mcgnic-%d", pid);
    *len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + n);
}

/* ---- GPU memory: the CUDA model, found among the loaded libraries ---- */

struct gpu_model {
    int (*deferred_write)(unsigned long long dst, const void *src, size_t n);
    int (*flush)(int target, int scope);
    int (*pointer_attr)(void *data, int attr, unsigned long long p);
    int (*retain)(void **ctx, int dev);
    int (*set_current)(void *ctx);
};

static struct gpu_model g_gpu;
static pthread_mutex_t g_gpu_mu = PTHREAD_MUTEX_INITIALIZER;

static int find_gpu_model(struct dl_phdr_info *info, size_t size, void *arg) {
    (void)size; (void)arg;
    if (!info->dlpi_name || !*info->dlpi_name) return 0;
    void *h = dlopen(info->dlpi_name, RTLD_NOW | RTLD_NOLOAD);
    if (!h) return 0;
    void *w = dlsym(h, "mcgModelDeferredWrite");
    if (!w) { dlclose(h); return 0; }
    /* Kept open: the model stays loaded as long as this one uses it. */
    *(void **)&g_gpu.deferred_write = w;
    *(void **)&g_gpu.flush = dlsym(h, "cuFlushGPUDirectRDMAWrites");
    *(void **)&g_gpu.pointer_attr = dlsym(h, "cuPointerGetAttribute");
    *(void **)&g_gpu.retain = dlsym(h, "cuDevicePrimaryCtxRetain");
    *(void **)&g_gpu.set_current = dlsym(h, "cuCtxSetCurrent");
    return 1;
}

/* The CUDA model, once it is loaded (looked for again until it is). */
static struct gpu_model *gpu(void) {
    pthread_mutex_lock(&g_gpu_mu);
    if (!g_gpu.deferred_write) dl_iterate_phdr(find_gpu_model, NULL);
    int ok = g_gpu.deferred_write && g_gpu.flush && g_gpu.pointer_attr && g_gpu.retain && g_gpu.set_current;
    pthread_mutex_unlock(&g_gpu_mu);
    return ok ? &g_gpu : NULL;
}

static int is_device_memory(const void *p) {
    struct gpu_model *m = gpu();
    unsigned int kind = 0;
    return m && m->pointer_attr(&kind, 2 /* MEMORY_TYPE */, (unsigned long long)(uintptr_t)p) == 0 && kind == 2;
}

/* Makes the GPUDirect writes so far visible, as a read through the GPU's
 * BAR does; on this thread, with the device's primary context current. */
static void gpu_flush(void) {
    struct gpu_model *m = gpu();
    void *ctx = NULL;
    if (m && m->retain(&ctx, 0) == 0 && m->set_current(ctx) == 0) m->flush(0, 100);
}

/* The MR that holds [addr, addr+len) under rkey and allows access, or NULL. */
static struct ibv_mr *find_mr(uint32_t rkey, uint64_t addr, uint64_t len, int access) {
    struct ibv_mr *found = NULL;
    pthread_mutex_lock(&g_mu);
    for (struct mr_entry *e = g_mrs; e; e = e->next) {
        uint64_t base = (uint64_t)(uintptr_t)e->mr.addr;
        if (e->mr.rkey == rkey && addr >= base && addr + len <= base + e->mr.length && addr + len >= addr &&
            (e->access & access) == access) {
            found = &e->mr;
            break;
        }
    }
    pthread_mutex_unlock(&g_mu);
    return found;
}

/* ---- the responder: one thread per incoming QP connection ---- */

struct posted { /* a write accepted but not yet visible */
    uint64_t raddr;
    int device;
    char *data;
    uint32_t len;
    struct timespec due;
    struct posted *next;
};

struct responder {
    int fd;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct posted *head, *tail;
    int done;
    struct responder *next; /* in g_responders */
};

/* Every live responder, so that deregistering an MR can wait for the
 * writes into it that were accepted and are not yet visible: a NIC stops
 * its DMA into a region before its deregistration returns. */
static pthread_mutex_t g_resp_mu = PTHREAD_MUTEX_INITIALIZER;
static struct responder *g_responders;

static void drain_range(uint64_t lo, uint64_t hi) {
    pthread_mutex_lock(&g_resp_mu);
    for (struct responder *r = g_responders; r; r = r->next) {
        pthread_mutex_lock(&r->mu);
        for (;;) {
            int busy = 0;
            for (struct posted *p = r->head; p; p = p->next)
                if (p->raddr < hi && lo < p->raddr + p->len) busy = 1;
            if (!busy) break; /* a closed connection's accepted writes still land: wait for them too */
            pthread_cond_wait(&r->cv, &r->mu);
        }
        pthread_mutex_unlock(&r->mu);
    }
    pthread_mutex_unlock(&g_resp_mu);
}

static void *applier(void *arg) {
    struct responder *r = arg;
    pthread_mutex_lock(&r->mu);
    for (;;) {
        while (!r->head && !r->done) pthread_cond_wait(&r->cv, &r->mu);
        if (!r->head) break;
        struct posted *p = r->head;
        pthread_cond_timedwait(&r->cv, &r->mu, &p->due);
        struct timespec now;
        clock_gettime(CLOCK_REALTIME, &now);
        if (now.tv_sec < p->due.tv_sec || (now.tv_sec == p->due.tv_sec && now.tv_nsec < p->due.tv_nsec)) continue;
        if (p->device) /* into GPU memory: a GPUDirect write, for kernels after a flush */
            gpu()->deferred_write(p->raddr, p->data, p->len);
        else
            memcpy((void *)(uintptr_t)p->raddr, p->data, p->len); /* now visible */
        r->head = p->next;
        if (!r->head) r->tail = NULL;
        free(p->data);
        free(p);
        pthread_cond_broadcast(&r->cv);
    }
    pthread_mutex_unlock(&r->mu);
    return NULL;
}

/* A READ or FLUSH on this QP: answered once the QP's earlier writes are
 * visible (and, into GPU memory, flushed for kernels). Returns the MR
 * the request may access, or NULL. */
static struct ibv_mr *settle(struct responder *r, const struct msg *m, int access) {
    struct ibv_mr *mr = find_mr(m->rkey, m->raddr, m->len, access);
    pthread_mutex_lock(&r->mu);
    while (r->head) pthread_cond_wait(&r->cv, &r->mu);
    pthread_mutex_unlock(&r->mu);
    if (mr && ((struct mr_entry *)mr)->device) gpu_flush();
    return mr;
}

static void *responder_main(void *arg) {
    struct responder *r = arg;
    pthread_t ap;
    pthread_create(&ap, NULL, applier, r);
    struct msg m;
    unsigned seed = (unsigned)(uintptr_t)r ^ (unsigned)getpid();
    while (read_full(r->fd, &m, sizeof m) == 0) {
        if (m.op == M_WRITE) {
            char *data = malloc(m.len ? m.len : 1);
            if (read_full(r->fd, data, m.len) != 0) { free(data); break; }
            pthread_mutex_lock(&g_mu);
            int nth = ++g_writes;
            pthread_mutex_unlock(&g_mu);
            struct msg reply = {.op = M_ACK, .wr_id = m.wr_id};
            /* Looked up and queued as one step against a deregistration,
             * which drains the queues after it took the MR away. */
            pthread_mutex_lock(&g_resp_mu);
            struct ibv_mr *mr = find_mr(m.rkey, m.raddr, m.len, IBV_ACCESS_REMOTE_WRITE);
            if (!mr || (g_fail_wr && nth == g_fail_wr)) {
                reply.op = M_NAK;
                free(data);
            } else {
                struct posted *p = calloc(1, sizeof *p);
                p->raddr = m.raddr;
                p->device = ((struct mr_entry *)mr)->device;
                p->data = data;
                p->len = m.len;
                clock_gettime(CLOCK_REALTIME, &p->due);
                long lag = g_lag_us > 0 ? rand_r(&seed) % (g_lag_us + 1) : 0;
                p->due.tv_nsec += lag * 1000;
                p->due.tv_sec += p->due.tv_nsec / 1000000000;
                p->due.tv_nsec %= 1000000000;
                pthread_mutex_lock(&r->mu);
                if (r->tail) r->tail->next = p; else r->head = p;
                r->tail = p;
                pthread_cond_broadcast(&r->cv);
                pthread_mutex_unlock(&r->mu);
            }
            pthread_mutex_unlock(&g_resp_mu);
            /* Acknowledged before it is visible: completion before visibility. */
            if (write_full(r->fd, &reply, sizeof reply) != 0) break;
        } else if ((m.op == M_FLUSH || m.op == M_READ) && g_stall_reads) {
            continue; /* never answered: the requester waits until it gives up */
        } else if (m.op == M_FLUSH) {
            struct ibv_mr *mr = settle(r, &m, MCG_ACCESS_FLUSH_GLOBAL);
            struct msg reply = {.op = mr ? M_FLUSHRESP : M_NAK, .wr_id = m.wr_id};
            if (write_full(r->fd, &reply, sizeof reply) != 0) break;
        } else if (m.op == M_READ) {
            struct ibv_mr *mr = settle(r, &m, IBV_ACCESS_REMOTE_READ);
            struct msg reply = {.op = mr ? M_READRESP : M_NAK, .wr_id = m.wr_id, .len = mr ? m.len : 0};
            if (write_full(r->fd, &reply, sizeof reply) != 0) break;
            if (mr && write_full(r->fd, (void *)(uintptr_t)m.raddr, m.len) != 0) break;
        } else if (m.op != M_HELLO) {
            break;
        }
    }
    pthread_mutex_lock(&r->mu);
    r->done = 1;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
    pthread_join(ap, NULL);
    close(r->fd);
    pthread_mutex_lock(&g_resp_mu);
    for (struct responder **pp = &g_responders; *pp; pp = &(*pp)->next)
        if (*pp == r) { *pp = r->next; break; }
    pthread_mutex_unlock(&g_resp_mu);
    free(r);
    return NULL;
}

static void *listener_main(void *arg) {
    int ls = (int)(intptr_t)arg;
    for (;;) {
        int fd = accept(ls, NULL, NULL);
        if (fd < 0) continue;
        struct responder *r = calloc(1, sizeof *r);
        r->fd = fd;
        pthread_mutex_init(&r->mu, NULL);
        pthread_cond_init(&r->cv, NULL);
        pthread_mutex_lock(&g_resp_mu);
        r->next = g_responders;
        g_responders = r;
        pthread_mutex_unlock(&g_resp_mu);
        pthread_t t;
        pthread_create(&t, NULL, responder_main, r);
        pthread_detach(t);
    }
    return NULL;
}

static int ensure_listening(void) {
    pthread_mutex_lock(&g_mu);
    if (g_listening) { pthread_mutex_unlock(&g_mu); return 0; }
    int ls = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un a;
    socklen_t len;
    sock_name(&a, &len, getpid());
    if (ls < 0 || bind(ls, (struct sockaddr *)&a, len) != 0 || listen(ls, 64) != 0) {
        pthread_mutex_unlock(&g_mu);
        return -1;
    }
    pthread_t t;
    pthread_create(&t, NULL, listener_main, (void *)(intptr_t)ls);
    pthread_detach(t);
    g_listening = 1;
    pthread_mutex_unlock(&g_mu);
    return 0;
}

/* ---- the requester ---- */

static void push_wc(struct ibv_cq *cq, uint64_t wr_id, enum ibv_wc_status st, enum ibv_wc_opcode op, uint32_t qpn, uint32_t len) {
    struct mcq *c = (struct mcq *)cq;
    struct wc_node *n = calloc(1, sizeof *n);
    n->wc.wr_id = wr_id;
    n->wc.status = st;
    n->wc.opcode = op;
    n->wc.qp_num = qpn;
    n->wc.byte_len = len;
    pthread_mutex_lock(&c->mu);
    if (c->tail) c->tail->next = n; else c->head = n;
    c->tail = n;
    pthread_mutex_unlock(&c->mu);
}

struct wr_meta { uint64_t wr_id; int signaled; };

static void *reader_main(void *arg) {
    struct mqp *q = arg;
    struct msg m;
    while (read_full(q->fd, &m, sizeof m) == 0) {
        if (m.op == M_ACK || m.op == M_NAK) {
            /* wr_id's low bit carries "signaled" (see post_send) */
            int signaled = (int)(m.wr_id & 1);
            uint64_t id = m.wr_id >> 1;
            if (m.op == M_NAK) {
                /* The failing request's completion first, then the error
                 * state: anything posted after it is flushed behind it. */
                push_wc(q->qp.send_cq, id, IBV_WC_REM_ACCESS_ERR, IBV_WC_RDMA_WRITE, q->qp.qp_num, 0);
                __atomic_store_n(&q->qp.state, IBV_QPS_ERR, __ATOMIC_RELEASE);
            } else if (signaled) {
                push_wc(q->qp.send_cq, id, IBV_WC_SUCCESS, IBV_WC_RDMA_WRITE, q->qp.qp_num, 0);
            }
        } else if (m.op == M_FLUSHRESP) {
            if (m.wr_id & 1) push_wc(q->qp.send_cq, m.wr_id >> 1, IBV_WC_SUCCESS, (enum ibv_wc_opcode)MCG_WC_FLUSH, q->qp.qp_num, 0);
        } else if (m.op == M_READRESP) {
            pthread_mutex_lock(&q->mu);
            struct pending_read **pp = &q->reads, *p = NULL;
            for (; *pp; pp = &(*pp)->next) {
                if ((*pp)->wr_id == m.wr_id) { p = *pp; *pp = p->next; break; }
            }
            pthread_mutex_unlock(&q->mu);
            char *buf = malloc(m.len ? m.len : 1);
            if (read_full(q->fd, buf, m.len) != 0) { free(buf); free(p); break; }
            if (p) {
                uint32_t off = 0;
                for (int i = 0; i < p->nsge && off < m.len; i++) {
                    uint32_t k = p->sge[i].length < m.len - off ? p->sge[i].length : m.len - off;
                    memcpy((void *)(uintptr_t)p->sge[i].addr, buf + off, k);
                    off += k;
                }
                if (p->signaled) push_wc(q->qp.send_cq, p->wr_id, IBV_WC_SUCCESS, IBV_WC_RDMA_READ, q->qp.qp_num, m.len);
                free(p);
            }
            free(buf);
        }
    }
    return NULL;
}

static int model_post_send(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad) {
    struct mqp *q = (struct mqp *)qp;
    for (; wr; wr = wr->next) {
        enum ibv_qp_state state = __atomic_load_n(&qp->state, __ATOMIC_ACQUIRE);
        if (state == IBV_QPS_ERR) { /* as a NIC does: accepted, then flushed in error */
            push_wc(qp->send_cq, wr->wr_id, IBV_WC_WR_FLUSH_ERR,
                    wr->opcode == IBV_WR_RDMA_READ ? IBV_WC_RDMA_READ : IBV_WC_RDMA_WRITE, qp->qp_num, 0);
            continue;
        }
        if (state != IBV_QPS_RTS) { *bad = wr; return EINVAL; }
        if (wr->num_sge > 4 || (wr->opcode != IBV_WR_RDMA_WRITE && wr->opcode != IBV_WR_RDMA_READ)) { *bad = wr; return EINVAL; }
        uint32_t total = 0;
        for (int i = 0; i < wr->num_sge; i++) total += wr->sg_list[i].length;
        int signaled = q->sq_sig_all || (wr->send_flags & IBV_SEND_SIGNALED);
        struct msg m = {.rkey = wr->wr.rdma.rkey, .raddr = wr->wr.rdma.remote_addr, .len = total, .qpn = qp->qp_num};
        if (wr->opcode == IBV_WR_RDMA_WRITE) {
            m.op = M_WRITE;
            m.wr_id = (wr->wr_id << 1) | (uint64_t)signaled;
            char *buf = malloc(total ? total : 1);
            uint32_t off = 0;
            for (int i = 0; i < wr->num_sge; i++) {
                memcpy(buf + off, (void *)(uintptr_t)wr->sg_list[i].addr, wr->sg_list[i].length);
                off += wr->sg_list[i].length;
            }
            int err = write_full(q->fd, &m, sizeof m) || write_full(q->fd, buf, total);
            free(buf);
            if (err) { *bad = wr; return EIO; }
        } else {
            struct pending_read *p = calloc(1, sizeof *p);
            p->wr_id = wr->wr_id;
            p->nsge = wr->num_sge;
            memcpy(p->sge, wr->sg_list, sizeof(struct ibv_sge) * (size_t)wr->num_sge);
            p->signaled = signaled;
            pthread_mutex_lock(&q->mu);
            p->next = q->reads;
            q->reads = p;
            pthread_mutex_unlock(&q->mu);
            m.op = M_READ;
            m.wr_id = wr->wr_id;
            if (write_full(q->fd, &m, sizeof m)) { *bad = wr; return EIO; }
        }
    }
    return 0;
}

static int model_poll_cq(struct ibv_cq *cq, int n, struct ibv_wc *wc) {
    struct mcq *c = (struct mcq *)cq;
    int k = 0;
    pthread_mutex_lock(&c->mu);
    while (k < n && c->head) {
        struct wc_node *x = c->head;
        c->head = x->next;
        if (!c->head) c->tail = NULL;
        wc[k++] = x->wc;
        free(x);
    }
    pthread_mutex_unlock(&c->mu);
    return k;
}

static int model_post_recv(struct ibv_qp *qp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad) {
    (void)qp; *bad = wr; return EOPNOTSUPP; /* mcguard posts no receives */
}

/* ---- the extended QP API: FLUSH only (the one op mcguard posts through it) ---- */

static void model_wr_start(struct ibv_qp_ex *qpx) {
    struct mqp *q = (struct mqp *)qpx;
    q->nbatch = q->overflow = 0;
}

static void model_wr_flush(struct ibv_qp_ex *qpx, uint32_t rkey, uint64_t raddr, size_t len, uint8_t type, uint8_t level) {
    struct mqp *q = (struct mqp *)qpx;
    if (q->nbatch == (int)(sizeof q->batch / sizeof q->batch[0]) || type != MCG_FLUSH_GLOBAL || level != MCG_FLUSH_RANGE) {
        q->overflow = 1;
        return;
    }
    q->batch[q->nbatch++] = (struct flush_wr){.wr_id = qpx->wr_id, .raddr = raddr, .len = len, .rkey = rkey,
                                              .signaled = q->sq_sig_all || (qpx->wr_flags & IBV_SEND_SIGNALED)};
}

static int model_wr_complete(struct ibv_qp_ex *qpx) {
    struct mqp *q = (struct mqp *)qpx;
    if (q->overflow) return EINVAL;
    enum ibv_qp_state state = __atomic_load_n(&q->qp.state, __ATOMIC_ACQUIRE);
    if (state != IBV_QPS_RTS && state != IBV_QPS_ERR) return EINVAL;
    for (int i = 0; i < q->nbatch; i++) {
        struct flush_wr *f = &q->batch[i];
        if (state == IBV_QPS_ERR) {
            push_wc(q->qp.send_cq, f->wr_id, IBV_WC_WR_FLUSH_ERR, (enum ibv_wc_opcode)MCG_WC_FLUSH, q->qp.qp_num, 0);
            continue;
        }
        struct msg m = {.op = M_FLUSH, .rkey = f->rkey, .raddr = f->raddr, .len = (uint32_t)f->len, .qpn = q->qp.qp_num,
                        .wr_id = (f->wr_id << 1) | (uint64_t)f->signaled};
        if (f->len > UINT32_MAX || write_full(q->fd, &m, sizeof m)) return EIO;
    }
    q->nbatch = 0;
    return 0;
}

static void model_wr_abort(struct ibv_qp_ex *qpx) { ((struct mqp *)qpx)->nbatch = 0; }

struct ibv_qp_ex *ibv_qp_to_qp_ex(struct ibv_qp *qp) {
    struct mqp *q = (struct mqp *)qp;
    return q->extended ? &q->qpx : NULL;
}

static void fill_device_attr(struct ibv_device_attr *a) {
    memset(a, 0, sizeof *a);
    a->phys_port_cnt = 1;
    a->max_qp_wr = 4096;
    a->max_sge = 4;
    a->max_qp_rd_atom = 16;
}

static int model_query_device_ex(struct ibv_context *ctx, const struct ibv_query_device_ex_input *in,
                                 struct ibv_device_attr_ex *a, size_t size) {
    (void)ctx; (void)in;
    if (size < sizeof *a) return EINVAL;
    memset(a, 0, size);
    fill_device_attr(&a->orig_attr);
    a->device_cap_flags_ex = g_no_flush ? 0 : MCG_DEVICE_FLUSH_GLOBAL;
    return 0;
}

static struct ibv_qp *create_qp(struct ibv_pd *pd, struct ibv_qp_init_attr *attr);

static struct ibv_qp *model_create_qp_ex(struct ibv_context *ctx, struct ibv_qp_init_attr_ex *attr) {
    (void)ctx;
    uint64_t known = IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_RDMA_READ | (g_no_flush ? 0 : MCG_QP_EX_WITH_FLUSH);
    if (!(attr->comp_mask & IBV_QP_INIT_ATTR_PD) || (attr->send_ops_flags & ~known)) {
        errno = EOPNOTSUPP; /* as a provider answers a send op it lacks */
        return NULL;
    }
    struct ibv_qp *qp = create_qp(attr->pd, (struct ibv_qp_init_attr *)attr);
    if (!qp) return NULL;
    struct mqp *q = (struct mqp *)qp;
    q->extended = 1;
    q->qpx.wr_start = model_wr_start;
    q->qpx.wr_complete = model_wr_complete;
    q->qpx.wr_abort = model_wr_abort;
    if (attr->send_ops_flags & MCG_QP_EX_WITH_FLUSH) {
        mcg_wr_flush_fn fn = model_wr_flush;
        memcpy(q->qpx_with_flush + MCG_WR_FLUSH_OFFSET, &fn, sizeof fn);
    }
    return qp;
}

/* ---- the verbs entry points ---- */

struct ibv_device **ibv_get_device_list(int *n) {
    g_lag_us = env_long("MCG_NIC_LAG_US");
    pthread_mutex_lock(&g_mu);
    g_fail_wr = (int)env_long("MCG_NIC_FAIL_WR");
    g_no_flush = env_long("MCG_NIC_NO_FLUSH") != 0;
    g_peermem = env_long("MCG_NIC_PEERMEM") != 0;
    g_stall_reads = env_long("MCG_NIC_STALL_READS") != 0;
    g_writes = 0; /* MCG_NIC_FAIL_WR counts from the latest device listing */
    pthread_mutex_unlock(&g_mu);
    snprintf(g_dev.name, sizeof g_dev.name, "mcgnic0");
    g_list[0] = &g_dev;
    g_list[1] = NULL;
    if (n) *n = 1;
    return g_list;
}

void ibv_free_device_list(struct ibv_device **list) { (void)list; }
const char *ibv_get_device_name(struct ibv_device *d) { return d->name; }

struct ibv_context *ibv_open_device(struct ibv_device *d) {
    if (ensure_listening() != 0) { errno = EIO; return NULL; }
    /* An extended context, so verbs.h's inline helpers find the
     * extended ops (query_device_ex, create_qp_ex) before it. */
    struct verbs_context *vctx = calloc(1, sizeof *vctx);
    vctx->sz = sizeof *vctx;
    vctx->query_device_ex = model_query_device_ex;
    vctx->create_qp_ex = model_create_qp_ex;
    struct ibv_context *ctx = &vctx->context;
    ctx->abi_compat = __VERBS_ABI_IS_EXTENDED;
    ctx->device = d;
    ctx->ops.post_send = model_post_send;
    ctx->ops.poll_cq = model_poll_cq;
    ctx->ops.post_recv = model_post_recv;
    return ctx;
}

int ibv_close_device(struct ibv_context *ctx) {
    free((char *)ctx - offsetof(struct verbs_context, context));
    return 0;
}

int ibv_query_device(struct ibv_context *ctx, struct ibv_device_attr *a) {
    (void)ctx;
    fill_device_attr(a);
    return 0;
}

int ibv_query_port(struct ibv_context *ctx, uint8_t port, struct _compat_ibv_port_attr *compat) {
    (void)ctx;
    if (port != 1) return EINVAL;
    /* The exported symbol fills the older layout: a prefix of ibv_port_attr. */
    struct ibv_port_attr *a = (struct ibv_port_attr *)compat;
    memset(a, 0, offsetof(struct ibv_port_attr, port_cap_flags2));
    a->state = IBV_PORT_ACTIVE;
    a->max_mtu = a->active_mtu = IBV_MTU_4096;
    a->link_layer = IBV_LINK_LAYER_ETHERNET;
    a->gid_tbl_len = 1;
    return 0;
}

int ibv_query_gid(struct ibv_context *ctx, uint8_t port, int index, union ibv_gid *gid) {
    (void)ctx;
    if (port != 1 || index != 0) return EINVAL;
    memset(gid, 0, sizeof *gid);
    memcpy(gid->raw, "MCGNIC", 6);
    uint32_t pid = (uint32_t)getpid();
    memcpy(gid->raw + 12, &pid, 4);
    return 0;
}

struct ibv_pd *ibv_alloc_pd(struct ibv_context *ctx) {
    struct ibv_pd *pd = calloc(1, sizeof *pd);
    pd->context = ctx;
    return pd;
}

int ibv_dealloc_pd(struct ibv_pd *pd) { free(pd); return 0; }

static struct ibv_mr *add_mr(struct ibv_pd *pd, void *addr, size_t len, int access, int device) {
    if (!addr || !len) { errno = EINVAL; return NULL; }
    if ((access & MCG_ACCESS_FLUSH_GLOBAL) && g_no_flush) { errno = EINVAL; return NULL; }
    struct mr_entry *e = calloc(1, sizeof *e);
    e->access = access;
    e->device = device;
    e->mr.context = pd->context;
    e->mr.pd = pd;
    e->mr.addr = addr;
    e->mr.length = len;
    pthread_mutex_lock(&g_mu);
    e->mr.lkey = e->mr.rkey = g_next_key++;
    e->next = g_mrs;
    g_mrs = e;
    pthread_mutex_unlock(&g_mu);
    return &e->mr;
}

struct ibv_mr *ibv_reg_mr(struct ibv_pd *pd, void *addr, size_t len, int access) {
    int device = is_device_memory(addr);
    if (device && !g_peermem) { errno = EFAULT; return NULL; } /* the kernel cannot pin GPU pages without peermem */
    return add_mr(pd, addr, len, access, device);
}

struct ibv_mr *ibv_reg_dmabuf_mr(struct ibv_pd *pd, uint64_t offset, size_t len, uint64_t iova, int fd, int access) {
    (void)offset;
    /* The model's dmabuf stands for GPU memory that peers address at iova. */
    if (fcntl(fd, F_GETFD) < 0) { errno = EBADF; return NULL; }
    if (!is_device_memory((void *)(uintptr_t)iova) || !is_device_memory((void *)(uintptr_t)(iova + len - 1))) {
        errno = EINVAL;
        return NULL;
    }
    return add_mr(pd, (void *)(uintptr_t)iova, len, access, 1);
}

int ibv_dereg_mr(struct ibv_mr *mr) {
    pthread_mutex_lock(&g_mu);
    for (struct mr_entry **pp = &g_mrs; *pp; pp = &(*pp)->next) {
        if (&(*pp)->mr == mr) {
            struct mr_entry *e = *pp;
            *pp = e->next;
            pthread_mutex_unlock(&g_mu);
            uint64_t lo = (uint64_t)(uintptr_t)e->mr.addr;
            drain_range(lo, lo + e->mr.length);
            free(e);
            return 0;
        }
    }
    pthread_mutex_unlock(&g_mu);
    return EINVAL;
}

struct ibv_cq *ibv_create_cq(struct ibv_context *ctx, int cqe, void *cq_context, struct ibv_comp_channel *ch, int vec) {
    (void)cq_context; (void)ch; (void)vec;
    struct mcq *c = calloc(1, sizeof *c);
    c->cq.context = ctx;
    c->cq.cqe = cqe;
    pthread_mutex_init(&c->mu, NULL);
    return &c->cq;
}

int ibv_destroy_cq(struct ibv_cq *cq) { free(cq); return 0; }

struct ibv_qp *ibv_create_qp(struct ibv_pd *pd, struct ibv_qp_init_attr *attr) { return create_qp(pd, attr); }

static struct ibv_qp *create_qp(struct ibv_pd *pd, struct ibv_qp_init_attr *attr) {
    if (attr->qp_type != IBV_QPT_RC) { errno = EINVAL; return NULL; }
    struct mqp *q = calloc(1, sizeof *q);
    q->qp.context = pd->context;
    q->qp.pd = pd;
    q->qp.send_cq = attr->send_cq;
    q->qp.recv_cq = attr->recv_cq;
    q->qp.qp_type = IBV_QPT_RC;
    q->qp.state = IBV_QPS_RESET;
    q->sq_sig_all = attr->sq_sig_all;
    q->fd = -1;
    pthread_mutex_init(&q->mu, NULL);
    pthread_mutex_lock(&g_mu);
    q->qp.qp_num = g_next_qpn++;
    pthread_mutex_unlock(&g_mu);
    return &q->qp;
}

static void disconnect(struct mqp *q) {
    if (q->fd >= 0) {
        shutdown(q->fd, SHUT_RDWR);
        pthread_join(q->reader, NULL);
        close(q->fd);
        q->fd = -1;
    }
}

int ibv_destroy_qp(struct ibv_qp *qp) {
    disconnect((struct mqp *)qp);
    free(qp);
    return 0;
}

/* The RC state machine, with the attribute masks each transition needs. */
int ibv_modify_qp(struct ibv_qp *qp, struct ibv_qp_attr *a, int mask) {
    struct mqp *q = (struct mqp *)qp;
    if (!(mask & IBV_QP_STATE)) return EINVAL;
    enum ibv_qp_state from = qp->state, to = a->qp_state;
    int need = 0;
    if (to == IBV_QPS_RESET || to == IBV_QPS_ERR) {
        if (to == IBV_QPS_RESET) disconnect(q);
        qp->state = to;
        return 0;
    }
    if (from == IBV_QPS_RESET && to == IBV_QPS_INIT) need = IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
    else if (from == IBV_QPS_INIT && to == IBV_QPS_RTR)
        need = IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
    else if (from == IBV_QPS_RTR && to == IBV_QPS_RTS)
        need = IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC;
    else return EINVAL;
    if ((mask & need) != need) return EINVAL;
    if (to == IBV_QPS_RTR) {
        if (memcmp(a->ah_attr.grh.dgid.raw, "MCGNIC", 6) != 0) return EINVAL;
        uint32_t pid;
        memcpy(&pid, a->ah_attr.grh.dgid.raw + 12, 4);
        int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        struct sockaddr_un sa;
        socklen_t len;
        sock_name(&sa, &len, (int)pid);
        if (fd < 0 || connect(fd, (struct sockaddr *)&sa, len) != 0) {
            if (fd >= 0) close(fd);
            return EHOSTUNREACH;
        }
        struct msg hello = {.op = M_HELLO, .qpn = a->dest_qp_num};
        write_full(fd, &hello, sizeof hello);
        q->fd = fd;
        pthread_create(&q->reader, NULL, reader_main, q);
    }
    qp->state = to;
    return 0;
}

int ibv_fork_init(void) { return 0; }
