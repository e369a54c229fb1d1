/* A software model of the CUDA driver, for tests on machines without a
 * GPU: the same entry points mcguard's loader asks for, "device" memory as
 * tagged host memory, and asynchronous visibility — a copy to or from the
 * device happens only when its stream (or the context) is synchronised,
 * and a GPUDirect-style write (mcgModelDeferredWrite) only at
 * cuFlushGPUDirectRDMAWrites or a context synchronisation. So a test can
 * show that synchronisation is needed, and that it is enough.
 *
 * Knobs (environment, read at cuInit): MCG_MODEL_NO_DEVICE=1 makes cuInit
 * fail with CUDA_ERROR_NO_DEVICE; MCG_MODEL_DRIVER_VERSION sets the version
 * cuDriverGetVersion reports; MCG_MODEL_NO_DMABUF=1 (read when asked) makes the device report
 * CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 0; MCG_MODEL_NO_LEGACY_IPC=1 makes
 * device memory report no legacy IPC handle (as VMM memory does), and
 * MCG_MODEL_IPC_OPEN_FAILS=1 makes cuIpcOpenMemHandle fail (as between
 * GPUs without peer access), both read when asked; MCG_MODEL_VMM=1 makes
 * device memory act as VMM memory created shareable as a POSIX file
 * descriptor (no legacy handle; CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES
 * says so; cuMemRetainAllocationHandle and cuMemExportToShareableHandle
 * give out its memfd, and an importer reserves, maps and must grant access
 * before it copies). mcgModelFailCopies(n) makes
 * the next n copy calls fail with CUDA_ERROR_ILLEGAL_ADDRESS.
 *
 * dmabuf export (cuMemGetHandleForAddressRange) hands out a memfd standing
 * for the dmabuf; the NIC model, given it, writes the device memory through
 * mcgModelDeferredWrite, so RDMA writes into "GPU" memory become visible to
 * kernels only at a flush, as GPUDirect writes do.
 *
 * CUDA IPC works across processes: device memory is a shared memfd
 * mapping, a handle names the exporting pid, its fd and the allocation's
 * buffer id, and cuIpcOpenMemHandle maps /proc/<pid>/fd/<fd> (so the
 * importer needs ptrace access to the exporter, as with any same-host
 * path). As the real driver does, it refuses a handle from its own
 * process and a handle already open here (PyTorch keeps a cache for that
 * reason), and wants the allocation's base. Device-to-device copies are
 * asynchronous like the others. */
#define _GNU_SOURCE
#include <pthread.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
enum {
    SUCCESS = 0, INVALID_VALUE = 1, NOT_INITIALIZED = 3, NO_DEVICE = 100, INVALID_DEVICE = 101,
    INVALID_CONTEXT = 201, NOT_FOUND = 500, ILLEGAL_ADDRESS = 700
};

typedef struct op {
    int kind; /* 0: host->device, 1: device->host, 2: device->device */
    char *dst;
    const char *src;
    size_t n;
    struct op *next;
} op;

typedef struct stream {
    op *head, *tail;
    struct stream *next;
} stream;

typedef struct region {
    char *p;
    size_t n;
    int pinned;                 /* 0: device memory, 1: pinned host memory */
    int fd;                     /* device memory: its memfd; -1 otherwise */
    unsigned long long id;      /* CU_POINTER_ATTRIBUTE_BUFFER_ID */
    int imported;               /* opened from another process's IPC handle, or mapped from a VMM handle */
    int mapped, access;         /* mapped by cuMemMap; cuMemSetAccess granted read-write */
    int from_pid;               /* imported: the exporter and its buffer id */
    unsigned long long from_id;
    struct region *next;
} region;

/* The model's CUipcMemHandle (64 bytes, opaque to callers). */
typedef struct { char reserved[64]; } CUipcMemHandle;
/* CUmemAccessDesc: CUmemLocation {type, id}, then the access flags. */
typedef struct { int type, id, flags; } CUmemAccessDesc_model;
typedef struct {
    char magic[8];
    int pid, fd;
    unsigned long long id, size;
} ipc_handle;
static const char ipc_magic[8] = "MCGIPC1";

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int initialized, version = 12040, fail_copies;
static unsigned long long next_buffer_id = 1;

/* Read on each use, so that one test process can have both devices. */
static int no_dmabuf(void) {
    const char *nd = getenv("MCG_MODEL_NO_DMABUF");
    return nd && *nd == '1';
}
static int knob(const char *name) {
    const char *v = getenv(name);
    return v && *v == '1';
}
static region *regions;
static stream *streams;
static op *deferred_head, *deferred_tail; /* GPUDirect-style writes not yet visible */
static char primary_ctx;                  /* one device, one context */
static __thread void *current_ctx;

static region *find(const void *p, size_t n) {
    for (region *r = regions; r; r = r->next)
        if ((const char *)p >= r->p && (const char *)p + n <= r->p + r->n && (const char *)p + n >= (const char *)p) return r;
    return NULL;
}

static void apply(op *o) {
    while (o) {
        op *next = o->next;
        memcpy(o->dst, o->src, o->n);
        free(o);
        o = next;
    }
}

static void drain(stream *s) {
    apply(s->head);
    s->head = s->tail = NULL;
}

static void enqueue(op **head, op **tail, op *o) {
    if (*tail) (*tail)->next = o; else *head = o;
    *tail = o;
}

CUresult cuInit(unsigned int flags) {
    (void)flags;
    const char *nodev = getenv("MCG_MODEL_NO_DEVICE");
    if (nodev && *nodev == '1') return NO_DEVICE;
    const char *v = getenv("MCG_MODEL_DRIVER_VERSION");
    pthread_mutex_lock(&mu);
    if (v) version = atoi(v);
    initialized = 1;
    pthread_mutex_unlock(&mu);
    return SUCCESS;
}

CUresult cuDriverGetVersion(int *v) {
    if (!v) return INVALID_VALUE;
    *v = version;
    return SUCCESS;
}

CUresult cuGetErrorName(CUresult r, const char **name) {
    switch (r) {
    case SUCCESS: *name = "CUDA_SUCCESS"; break;
    case INVALID_VALUE: *name = "CUDA_ERROR_INVALID_VALUE"; break;
    case NOT_INITIALIZED: *name = "CUDA_ERROR_NOT_INITIALIZED"; break;
    case NO_DEVICE: *name = "CUDA_ERROR_NO_DEVICE"; break;
    case INVALID_DEVICE: *name = "CUDA_ERROR_INVALID_DEVICE"; break;
    case INVALID_CONTEXT: *name = "CUDA_ERROR_INVALID_CONTEXT"; break;
    case ILLEGAL_ADDRESS: *name = "CUDA_ERROR_ILLEGAL_ADDRESS"; break;
    case 208: *name = "CUDA_ERROR_ALREADY_MAPPED"; break;
    case 400: *name = "CUDA_ERROR_INVALID_HANDLE"; break;
    case 217: *name = "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED"; break;
    default: return INVALID_VALUE;
    }
    return SUCCESS;
}

CUresult cuPointerGetAttribute(void *data, int attr, CUdeviceptr ptr) {
    pthread_mutex_lock(&mu);
    region *r = find((void *)(uintptr_t)ptr, 1);
    pthread_mutex_unlock(&mu);
    if (!r) return INVALID_VALUE; /* not memory the driver knows */
    switch (attr) {
    case 2: *(unsigned int *)data = r->pinned ? 1 : 2; return SUCCESS; /* MEMORY_TYPE: HOST or DEVICE */
    case 7: *(unsigned long long *)data = r->id; return SUCCESS;      /* BUFFER_ID */
    case 10: *(int *)data = !r->pinned && !r->imported && !knob("MCG_MODEL_NO_LEGACY_IPC") && !knob("MCG_MODEL_VMM"); return SUCCESS; /* IS_LEGACY_CUDA_IPC_CAPABLE */
    case 14: *(unsigned int *)data = !r->pinned && !r->imported && knob("MCG_MODEL_VMM"); return SUCCESS; /* ALLOWED_HANDLE_TYPES: POSIX_FILE_DESCRIPTOR */
    case 9: *(int *)data = 0; return SUCCESS;                          /* DEVICE_ORDINAL */
    case 1: *(void **)data = &primary_ctx; return SUCCESS;             /* CONTEXT */
    }
    return INVALID_VALUE;
}

CUresult cuDeviceGet(int *dev, int ordinal) {
    if (ordinal != 0) return INVALID_DEVICE;
    *dev = 0;
    return SUCCESS;
}

CUresult cuDevicePrimaryCtxRetain(void **ctx, int dev) {
    if (dev != 0) return INVALID_DEVICE;
    *ctx = &primary_ctx;
    return SUCCESS;
}

CUresult cuCtxSetCurrent(void *ctx) {
    current_ctx = ctx;
    return SUCCESS;
}

static void add_region(region *r) {
    pthread_mutex_lock(&mu);
    r->id = next_buffer_id++;
    r->next = regions;
    regions = r;
    pthread_mutex_unlock(&mu);
}

/* Device memory is a shared memfd mapping, so that IPC can map it in
 * another process; pinned host memory is plain memory. */
static CUresult alloc(void **p, size_t n, int pinned) {
    if (!initialized) return NOT_INITIALIZED;
    if (n == 0) return INVALID_VALUE;
    region *r = calloc(1, sizeof *r);
    size_t rounded = (n + 4095) / 4096 * 4096;
    r->fd = -1;
    if (pinned) {
        r->p = aligned_alloc(4096, rounded);
        if (!r->p) { free(r); return INVALID_VALUE; }
        memset(r->p, 0, n);
    } else {
        r->fd = memfd_create("mcgmodel-device", MFD_CLOEXEC);
        if (r->fd < 0 || ftruncate(r->fd, rounded) != 0) goto fail;
        r->p = mmap(NULL, rounded, PROT_READ | PROT_WRITE, MAP_SHARED, r->fd, 0);
        if (r->p == MAP_FAILED) goto fail;
    }
    r->n = n;
    r->pinned = pinned;
    add_region(r);
    *p = r->p;
    return SUCCESS;
fail:
    if (r->fd >= 0) close(r->fd);
    free(r);
    return INVALID_VALUE;
}

static void free_region(region *r) {
    if (r->pinned) {
        free(r->p);
    } else {
        munmap(r->p, (r->n + 4095) / 4096 * 4096);
        if (r->fd >= 0) close(r->fd);
    }
    free(r);
}

/* release frees the region at p: an allocation of this process, or
 * (imported) a mapping opened from another's IPC handle. */
static CUresult release(const void *p, int imported) {
    pthread_mutex_lock(&mu);
    for (region **pp = &regions; *pp; pp = &(*pp)->next) {
        if ((*pp)->p == p && (*pp)->imported == imported) {
            region *r = *pp;
            *pp = r->next;
            pthread_mutex_unlock(&mu);
            free_region(r);
            return SUCCESS;
        }
    }
    pthread_mutex_unlock(&mu);
    return INVALID_VALUE;
}

CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) { return alloc((void **)p, n, 0); }
CUresult cuMemFree_v2(CUdeviceptr p) { return release((void *)(uintptr_t)p, 0); }
CUresult cuMemHostAlloc(void **p, size_t n, unsigned int flags) { (void)flags; return alloc(p, n, 1); }
CUresult cuMemFreeHost(void *p) { return release(p, 0); }

CUresult cuStreamCreate(void **s, unsigned int flags) {
    (void)flags;
    if (current_ctx != &primary_ctx) return INVALID_CONTEXT;
    stream *st = calloc(1, sizeof *st);
    pthread_mutex_lock(&mu);
    st->next = streams;
    streams = st;
    pthread_mutex_unlock(&mu);
    *s = st;
    return SUCCESS;
}

CUresult cuStreamSynchronize(void *s) {
    if (current_ctx != &primary_ctx) return INVALID_CONTEXT;
    pthread_mutex_lock(&mu);
    if (s) drain((stream *)s);
    pthread_mutex_unlock(&mu);
    return SUCCESS;
}

CUresult cuCtxSynchronize(void) {
    if (current_ctx != &primary_ctx) return INVALID_CONTEXT;
    pthread_mutex_lock(&mu);
    for (stream *s = streams; s; s = s->next) drain(s);
    apply(deferred_head);
    deferred_head = deferred_tail = NULL;
    pthread_mutex_unlock(&mu);
    return SUCCESS;
}

CUresult cuFlushGPUDirectRDMAWrites(int target, int scope) {
    if (target != 0 || (scope != 100 && scope != 200)) return INVALID_VALUE;
    if (current_ctx != &primary_ctx) return INVALID_CONTEXT;
    pthread_mutex_lock(&mu);
    apply(deferred_head);
    deferred_head = deferred_tail = NULL;
    pthread_mutex_unlock(&mu);
    return SUCCESS;
}

static CUresult copy_async(int kind, void *dst, const void *src, size_t n, void *s) {
    if (current_ctx != &primary_ctx) return INVALID_CONTEXT;
    pthread_mutex_lock(&mu);
    if (fail_copies > 0) {
        fail_copies--;
        pthread_mutex_unlock(&mu);
        return ILLEGAL_ADDRESS;
    }
    /* the device end(s): the destination (0: host to device, 2: device
     * to device), the source (1: device to host, 2) */
    region *d = kind != 1 ? find(dst, n) : NULL, *r = kind != 0 ? find(src, n) : NULL;
    if ((kind != 1 && (!d || d->pinned || (d->mapped && !d->access))) || (kind != 0 && (!r || r->pinned || (r->mapped && !r->access))) || !s) {
        pthread_mutex_unlock(&mu);
        return INVALID_VALUE;
    }
    op *o = calloc(1, sizeof *o);
    o->kind = kind;
    o->dst = dst;
    o->src = src;
    o->n = n;
    enqueue(&((stream *)s)->head, &((stream *)s)->tail, o);
    pthread_mutex_unlock(&mu);
    return SUCCESS;
}

CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, void *s) {
    return copy_async(0, (void *)(uintptr_t)dst, src, n, s);
}

CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, void *s) {
    return copy_async(1, dst, (const void *)(uintptr_t)src, n, s);
}

CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, void *s) {
    return copy_async(2, (void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n, s);
}

enum { ALREADY_MAPPED = 208, INVALID_HANDLE = 400 };

CUresult cuIpcGetMemHandle(CUipcMemHandle *h, CUdeviceptr p) {
    if (!h) return INVALID_VALUE;
    pthread_mutex_lock(&mu);
    region *r = find((void *)(uintptr_t)p, 1);
    int ok = r && !r->pinned && !r->imported && (CUdeviceptr)(uintptr_t)r->p == p && !knob("MCG_MODEL_NO_LEGACY_IPC") && !knob("MCG_MODEL_VMM");
    ipc_handle ih = {0};
    if (ok) {
        memcpy(ih.magic, ipc_magic, sizeof ih.magic);
        ih.pid = getpid();
        ih.fd = r->fd;
        ih.id = r->id;
        ih.size = r->n;
    }
    pthread_mutex_unlock(&mu);
    if (!ok) return INVALID_VALUE; /* not the base of a device allocation of this process */
    memset(h, 0, sizeof *h);
    memcpy(h, &ih, sizeof ih);
    return SUCCESS;
}

CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *p, CUipcMemHandle h, unsigned int flags) {
    if (!p || flags != 1) return INVALID_VALUE; /* CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS */
    if (current_ctx != &primary_ctx) return INVALID_CONTEXT;
    ipc_handle ih;
    memcpy(&ih, &h, sizeof ih);
    if (memcmp(ih.magic, ipc_magic, sizeof ih.magic) != 0 || ih.size == 0) return INVALID_HANDLE;
    if (ih.pid == getpid()) return INVALID_CONTEXT; /* a process cannot open its own handle */
    if (knob("MCG_MODEL_IPC_OPEN_FAILS")) return 217;  /* CUDA_ERROR_PEER_ACCESS_UNSUPPORTED */
    pthread_mutex_lock(&mu);
    for (region *r = regions; r; r = r->next) {
        if (r->imported && r->from_pid == ih.pid && r->from_id == ih.id) {
            pthread_mutex_unlock(&mu);
            return ALREADY_MAPPED;
        }
    }
    pthread_mutex_unlock(&mu);
    char path[64], link[128], want[64];
    snprintf(path, sizeof path, "/proc/%d/fd/%d", ih.pid, ih.fd);
    /* the fd must still be that allocation's memfd: a freed one is gone */
    ssize_t k = readlink(path, link, sizeof link - 1);
    if (k < 0) return INVALID_HANDLE;
    link[k] = 0;
    snprintf(want, sizeof want, "/memfd:mcgmodel-device");
    if (strncmp(link, want, strlen(want)) != 0) return INVALID_HANDLE;
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) return INVALID_HANDLE;
    size_t rounded = (ih.size + 4095) / 4096 * 4096;
    struct stat st;
    if (fstat(fd, &st) != 0 || (size_t)st.st_size != rounded) {
        close(fd);
        return INVALID_HANDLE;
    }
    void *m = mmap(NULL, rounded, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED) return INVALID_HANDLE;
    region *r = calloc(1, sizeof *r);
    r->p = m;
    r->n = ih.size;
    r->fd = -1;
    r->imported = 1;
    r->from_pid = ih.pid;
    r->from_id = ih.id;
    add_region(r);
    *p = (CUdeviceptr)(uintptr_t)m;
    return SUCCESS;
}

CUresult cuIpcCloseMemHandle(CUdeviceptr p) { return release((void *)(uintptr_t)p, 1); }

/* VMM sharing. A generic allocation handle is a vmm_handle *: this
 * process's allocation (its region's memfd) or one imported from a
 * descriptor (a copy of it, kept until released). Sizes round up to the
 * model's granularity, a page. */
typedef struct { int fd; size_t size; int imported; } vmm_handle;
#define ROUND(n) (((n) + 4095) / 4096 * 4096)

CUresult cuMemRetainAllocationHandle(unsigned long long *h, void *addr) {
    if (!h) return INVALID_VALUE;
    pthread_mutex_lock(&mu);
    region *r = find(addr, 1);
    int ok = r && !r->pinned && !r->imported && r->fd >= 0 && knob("MCG_MODEL_VMM");
    vmm_handle v = {ok ? r->fd : -1, ok ? r->n : 0, 0};
    pthread_mutex_unlock(&mu);
    if (!ok) return INVALID_VALUE; /* not VMM memory of this process */
    vmm_handle *hv = malloc(sizeof *hv);
    *hv = v;
    *h = (unsigned long long)(uintptr_t)hv;
    return SUCCESS;
}

CUresult cuMemExportToShareableHandle(void *sh, unsigned long long h, int type, unsigned long long flags) {
    vmm_handle *v = (vmm_handle *)(uintptr_t)h;
    if (!sh || !v || type != 1 || flags != 0) return INVALID_VALUE; /* POSIX_FILE_DESCRIPTOR */
    int fd = fcntl(v->fd, F_DUPFD_CLOEXEC, 0);
    if (fd < 0) return INVALID_VALUE;
    *(int *)sh = fd;
    return SUCCESS;
}

CUresult cuMemImportFromShareableHandle(unsigned long long *h, void *os_handle, int type) {
    if (!h || type != 1) return INVALID_VALUE;
    int fd = (int)(intptr_t)os_handle;
    char path[64], link[128];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    ssize_t k = readlink(path, link, sizeof link - 1);
    if (k < 0) return INVALID_HANDLE;
    link[k] = 0;
    if (strncmp(link, "/memfd:mcgmodel-device", 22) != 0) return INVALID_HANDLE;
    struct stat st;
    if (fstat(fd, &st) != 0) return INVALID_HANDLE;
    int own = fcntl(fd, F_DUPFD_CLOEXEC, 0); /* the caller keeps (and closes) its descriptor */
    if (own < 0) return INVALID_VALUE;
    vmm_handle *v = malloc(sizeof *v);
    v->fd = own;
    v->size = (size_t)st.st_size;
    v->imported = 1;
    *h = (unsigned long long)(uintptr_t)v;
    return SUCCESS;
}

CUresult cuMemRelease(unsigned long long h) {
    vmm_handle *v = (vmm_handle *)(uintptr_t)h;
    if (!v) return INVALID_VALUE;
    if (v->imported) close(v->fd); /* a mapping keeps the memory */
    free(v);
    return SUCCESS;
}

CUresult cuMemAddressReserve(CUdeviceptr *p, size_t size, size_t align, CUdeviceptr addr, unsigned long long flags) {
    (void)align;
    (void)addr;
    if (!p || size == 0 || flags != 0) return INVALID_VALUE;
    void *m = mmap(NULL, ROUND(size), PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) return INVALID_VALUE;
    *p = (CUdeviceptr)(uintptr_t)m;
    return SUCCESS;
}

CUresult cuMemAddressFree(CUdeviceptr p, size_t size) {
    return munmap((void *)(uintptr_t)p, ROUND(size)) == 0 ? SUCCESS : INVALID_VALUE;
}

CUresult cuMemMap(CUdeviceptr p, size_t size, size_t offset, unsigned long long h, unsigned long long flags) {
    vmm_handle *v = (vmm_handle *)(uintptr_t)h;
    if (!v || offset != 0 || flags != 0 || size == 0 || ROUND(size) > ROUND(v->size)) return INVALID_VALUE;
    /* no access until cuMemSetAccess, as on the real driver */
    void *m = mmap((void *)(uintptr_t)p, ROUND(size), PROT_NONE, MAP_SHARED | MAP_FIXED, v->fd, 0);
    if (m == MAP_FAILED) return INVALID_VALUE;
    region *r = calloc(1, sizeof *r);
    r->p = m;
    r->n = size;
    r->fd = -1;
    r->imported = 1;
    r->mapped = 1;
    add_region(r);
    return SUCCESS;
}

CUresult cuMemSetAccess(CUdeviceptr p, size_t size, const CUmemAccessDesc_model *d, size_t count) {
    if (!d || count != 1 || d->type != 1 || d->id != 0 || d->flags != 3) return INVALID_VALUE; /* DEVICE 0, READWRITE */
    pthread_mutex_lock(&mu);
    region *r = find((void *)(uintptr_t)p, size);
    int ok = r && r->mapped && mprotect(r->p, ROUND(r->n), PROT_READ | PROT_WRITE) == 0;
    if (ok) r->access = 1;
    pthread_mutex_unlock(&mu);
    return ok ? SUCCESS : INVALID_VALUE;
}

CUresult cuMemUnmap(CUdeviceptr p, size_t size) {
    pthread_mutex_lock(&mu);
    for (region **pp = &regions; *pp; pp = &(*pp)->next) {
        region *r = *pp;
        if (r->mapped && (CUdeviceptr)(uintptr_t)r->p == p) {
            *pp = r->next;
            pthread_mutex_unlock(&mu);
            /* back to a bare reservation, for cuMemAddressFree */
            mmap(r->p, ROUND(size), PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
            free(r);
            return SUCCESS;
        }
    }
    pthread_mutex_unlock(&mu);
    return INVALID_VALUE;
}

enum { NOT_SUPPORTED = 801 };

CUresult cuDeviceGetAttribute(int *v, int attr, int dev) {
    if (dev != 0) return INVALID_DEVICE;
    if (attr != 124) return INVALID_VALUE; /* the model answers DMA_BUF_SUPPORTED only */
    *v = !no_dmabuf();
    return SUCCESS;
}

CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr p) {
    pthread_mutex_lock(&mu);
    region *r = find((void *)(uintptr_t)p, 1);
    if (r) {
        if (base) *base = (CUdeviceptr)(uintptr_t)r->p;
        if (size) *size = r->n;
    }
    pthread_mutex_unlock(&mu);
    return r ? SUCCESS : INVALID_VALUE;
}

CUresult cuMemGetHandleForAddressRange(void *handle, CUdeviceptr p, size_t n, int type, unsigned long long flags) {
    if (type != 1 || flags != 0 || (p | n) % 4096 != 0) return INVALID_VALUE; /* DMA_BUF_FD, page-aligned */
    if (no_dmabuf()) return NOT_SUPPORTED;
    pthread_mutex_lock(&mu);
    region *r = find((void *)(uintptr_t)p, 1);
    pthread_mutex_unlock(&mu);
    /* an allocation is backed in whole pages */
    if (!r || r->pinned || p + n > (CUdeviceptr)(uintptr_t)r->p + (r->n + 4095) / 4096 * 4096) return INVALID_VALUE;
    int fd = memfd_create("mcgmodel-dmabuf", MFD_CLOEXEC);
    if (fd < 0) return INVALID_VALUE;
    *(int *)handle = fd;
    return SUCCESS;
}

/* Model only: a write into device memory by a "NIC", visible after a flush. */
int mcgModelDeferredWrite(CUdeviceptr dst, const void *src, size_t n) {
    pthread_mutex_lock(&mu);
    region *dev = find((void *)(uintptr_t)dst, n);
    if (!dev || dev->pinned) {
        pthread_mutex_unlock(&mu);
        return INVALID_VALUE;
    }
    op *o = calloc(1, sizeof *o);
    char *copy = malloc(n);
    memcpy(copy, src, n);
    o->dst = (char *)(uintptr_t)dst;
    o->src = copy; /* leaked on purpose: a model, freed at exit */
    o->n = n;
    enqueue(&deferred_head, &deferred_tail, o);
    pthread_mutex_unlock(&mu);
    return SUCCESS;
}

void mcgModelFailCopies(int n) {
    pthread_mutex_lock(&mu);
    fail_copies = n;
    pthread_mutex_unlock(&mu);
}

struct entry { const char *name; void *fn; };

CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, unsigned long long flags) {
    (void)cudaVersion;
    (void)flags;
    static const struct entry table[] = {
        {"cuInit", (void *)cuInit},
        {"cuDriverGetVersion", (void *)cuDriverGetVersion},
        {"cuGetErrorName", (void *)cuGetErrorName},
        {"cuPointerGetAttribute", (void *)cuPointerGetAttribute},
        {"cuDeviceGet", (void *)cuDeviceGet},
        {"cuDevicePrimaryCtxRetain", (void *)cuDevicePrimaryCtxRetain},
        {"cuCtxSetCurrent", (void *)cuCtxSetCurrent},
        {"cuCtxSynchronize", (void *)cuCtxSynchronize},
        {"cuStreamCreate", (void *)cuStreamCreate},
        {"cuStreamSynchronize", (void *)cuStreamSynchronize},
        {"cuMemAlloc", (void *)cuMemAlloc_v2},
        {"cuMemFree", (void *)cuMemFree_v2},
        {"cuMemHostAlloc", (void *)cuMemHostAlloc},
        {"cuMemFreeHost", (void *)cuMemFreeHost},
        {"cuMemcpyDtoHAsync", (void *)cuMemcpyDtoHAsync_v2},
        {"cuMemcpyHtoDAsync", (void *)cuMemcpyHtoDAsync_v2},
        {"cuMemcpyDtoDAsync", (void *)cuMemcpyDtoDAsync_v2},
        {"cuIpcGetMemHandle", (void *)cuIpcGetMemHandle},
        {"cuIpcOpenMemHandle", (void *)cuIpcOpenMemHandle_v2},
        {"cuIpcCloseMemHandle", (void *)cuIpcCloseMemHandle},
        {"cuFlushGPUDirectRDMAWrites", (void *)cuFlushGPUDirectRDMAWrites},
        {"cuDeviceGetAttribute", (void *)cuDeviceGetAttribute},
        {"cuMemGetAddressRange", (void *)cuMemGetAddressRange_v2},
        {"cuMemGetHandleForAddressRange", (void *)cuMemGetHandleForAddressRange},
        {"cuMemRetainAllocationHandle", (void *)cuMemRetainAllocationHandle},
        {"cuMemExportToShareableHandle", (void *)cuMemExportToShareableHandle},
        {"cuMemImportFromShareableHandle", (void *)cuMemImportFromShareableHandle},
        {"cuMemRelease", (void *)cuMemRelease},
        {"cuMemAddressReserve", (void *)cuMemAddressReserve},
        {"cuMemAddressFree", (void *)cuMemAddressFree},
        {"cuMemMap", (void *)cuMemMap},
        {"cuMemUnmap", (void *)cuMemUnmap},
        {"cuMemSetAccess", (void *)cuMemSetAccess},
    };
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++) {
        if (strcmp(table[i].name, symbol) == 0) {
            *pfn = table[i].fn;
            return SUCCESS;
        }
    }
    *pfn = NULL;
    return NOT_FOUND;
}
