/* The few CUDA driver API entry points mcguard uses, declared here (Debian
 * has no cuda.h) with the types and values of the CUDA documentation, and
 * a table of them filled at run time: libcuda is dlopen'd, never linked.
 * Declarations only: cgo copies this into generated code. */
#ifndef MCGUARD_CUDA_SHIM_H
#define MCGUARD_CUDA_SHIM_H
#include <stddef.h>
#include <stdint.h>

typedef int CUresult;           /* CUDA_SUCCESS = 0 */
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUstream;
typedef unsigned long long CUdeviceptr;

#define MCG_CUDA_SUCCESS 0
#define MCG_CU_POINTER_ATTRIBUTE_CONTEXT 1
#define MCG_CU_POINTER_ATTRIBUTE_MEMORY_TYPE 2
#define MCG_CU_POINTER_ATTRIBUTE_BUFFER_ID 7
#define MCG_CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL 9
#define MCG_CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE 10
#define MCG_CU_MEMORYTYPE_HOST 1
#define MCG_CU_MEMORYTYPE_DEVICE 2
#define MCG_CU_MEMORYTYPE_UNIFIED 4
#define MCG_CU_MEMHOSTALLOC_PORTABLE 0x01
#define MCG_CU_STREAM_NON_BLOCKING 0x1
#define MCG_CU_FLUSH_TARGET_CURRENT_CTX 0
#define MCG_CU_FLUSH_TO_OWNER 100
/* cuGetProcAddress and cuFlushGPUDirectRDMAWrites arrived in CUDA 11.3. */
#define MCG_CUDA_MIN_DRIVER 11030
/* dmabuf export of device memory (CUDA 11.7), for RDMA registration. */
#define MCG_CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED 124
#define MCG_CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD 1
#define MCG_CUDA_DMABUF_DRIVER 11070
#define MCG_CUDA_MISSING (-2) /* an optional entry point this driver lacks */
/* CUDA IPC of cuMemAlloc'd memory, for same-host GPU-to-GPU copies. */
#define MCG_CU_IPC_HANDLE_SIZE 64
#define MCG_CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS 0x1
typedef struct { char reserved[MCG_CU_IPC_HANDLE_SIZE]; } CUipcMemHandle; /* passed by value */
/* VMM memory (cuMemCreate) shared as a POSIX file descriptor (CUDA 10.2+). */
typedef unsigned long long CUmemGenericAllocationHandle;
#define MCG_CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES 14
#define MCG_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR 0x1
#define MCG_CU_MEM_LOCATION_TYPE_DEVICE 0x1
#define MCG_CU_MEM_ACCESS_FLAGS_PROT_READWRITE 0x3
typedef struct { int type; int id; } CUmemLocation;
typedef struct { CUmemLocation location; int flags; } CUmemAccessDesc;

struct mcg_cuda {
    void *lib;
    int driver_version;
    CUresult (*cuInit)(unsigned int);
    CUresult (*cuDriverGetVersion)(int *);
    CUresult (*cuGetProcAddress)(const char *, void **, int, unsigned long long);
    CUresult (*cuGetErrorName)(CUresult, const char **);
    CUresult (*cuPointerGetAttribute)(void *, int, CUdeviceptr);
    CUresult (*cuDeviceGet)(CUdevice *, int);
    CUresult (*cuDevicePrimaryCtxRetain)(CUcontext *, CUdevice);
    CUresult (*cuCtxSetCurrent)(CUcontext);
    CUresult (*cuCtxSynchronize)(void);
    CUresult (*cuStreamCreate)(CUstream *, unsigned int);
    CUresult (*cuStreamSynchronize)(CUstream);
    CUresult (*cuMemHostAlloc)(void **, size_t, unsigned int);
    CUresult (*cuMemFreeHost)(void *);
    CUresult (*cuMemcpyDtoHAsync)(void *, CUdeviceptr, size_t, CUstream);
    CUresult (*cuMemcpyHtoDAsync)(CUdeviceptr, const void *, size_t, CUstream);
    CUresult (*cuFlushGPUDirectRDMAWrites)(int, int); /* NULL when the driver lacks it */
    /* optional, for dmabuf export: NULL when the driver lacks them */
    CUresult (*cuDeviceGetAttribute)(int *, int, CUdevice);
    CUresult (*cuMemGetAddressRange)(CUdeviceptr *, size_t *, CUdeviceptr);
    CUresult (*cuMemGetHandleForAddressRange)(void *, CUdeviceptr, size_t, int, unsigned long long);
    /* optional, for CUDA IPC: NULL when the driver lacks them */
    CUresult (*cuIpcGetMemHandle)(CUipcMemHandle *, CUdeviceptr);
    CUresult (*cuIpcOpenMemHandle)(CUdeviceptr *, CUipcMemHandle, unsigned int);
    CUresult (*cuIpcCloseMemHandle)(CUdeviceptr);
    CUresult (*cuMemcpyDtoDAsync)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
    /* optional, for sharing VMM memory: NULL when the driver lacks them */
    CUresult (*cuMemRetainAllocationHandle)(CUmemGenericAllocationHandle *, void *);
    CUresult (*cuMemExportToShareableHandle)(void *, CUmemGenericAllocationHandle, int, unsigned long long);
    CUresult (*cuMemImportFromShareableHandle)(CUmemGenericAllocationHandle *, void *, int);
    CUresult (*cuMemRelease)(CUmemGenericAllocationHandle);
    CUresult (*cuMemAddressReserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
    CUresult (*cuMemAddressFree)(CUdeviceptr, size_t);
    CUresult (*cuMemMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
    CUresult (*cuMemUnmap)(CUdeviceptr, size_t);
    CUresult (*cuMemSetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
};

/* Loads the table from path; on failure returns a CUresult-like code (or
 * -1 for dlopen/dlsym failures) and writes a message into err. */
int mcg_cuda_load(const char *path, struct mcg_cuda *c, char *err, size_t errlen);

/* Calls through the table (cgo cannot call C function pointers). */
CUresult mcg_cu_pointer_get_attribute(struct mcg_cuda *c, void *data, int attr, CUdeviceptr p);
CUresult mcg_cu_device_primary_ctx(struct mcg_cuda *c, int ordinal, CUcontext *ctx);
CUresult mcg_cu_ctx_set_current(struct mcg_cuda *c, CUcontext ctx);
CUresult mcg_cu_ctx_synchronize(struct mcg_cuda *c);
CUresult mcg_cu_stream_create(struct mcg_cuda *c, CUstream *s);
CUresult mcg_cu_stream_synchronize(struct mcg_cuda *c, CUstream s);
CUresult mcg_cu_mem_host_alloc(struct mcg_cuda *c, void **p, size_t n);
CUresult mcg_cu_mem_free_host(struct mcg_cuda *c, void *p);
CUresult mcg_cu_dtoh_async(struct mcg_cuda *c, void *dst, CUdeviceptr src, size_t n, CUstream s);
CUresult mcg_cu_htod_async(struct mcg_cuda *c, CUdeviceptr dst, const void *src, size_t n, CUstream s);
CUresult mcg_cu_flush_gpudirect(struct mcg_cuda *c);
/* dmabuf export: MCG_CUDA_MISSING when the driver lacks the entry point. */
CUresult mcg_cu_dmabuf_supported(struct mcg_cuda *c, int ordinal, int *supported);
CUresult mcg_cu_mem_get_address_range(struct mcg_cuda *c, CUdeviceptr p, CUdeviceptr *base, size_t *size);
CUresult mcg_cu_mem_get_dmabuf_fd(struct mcg_cuda *c, CUdeviceptr base, size_t size, int *fd);
/* CUDA IPC: MCG_CUDA_MISSING when the driver lacks the entry points. The
 * handle is MCG_CU_IPC_HANDLE_SIZE bytes. */
CUresult mcg_cu_ipc_get(struct mcg_cuda *c, void *handle, CUdeviceptr base);
CUresult mcg_cu_ipc_open(struct mcg_cuda *c, CUdeviceptr *p, const void *handle);
CUresult mcg_cu_ipc_close(struct mcg_cuda *c, CUdeviceptr p);
CUresult mcg_cu_dtod_async(struct mcg_cuda *c, CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s);
/* VMM sharing: MCG_CUDA_MISSING when the driver lacks the entry points.
 * export: a new POSIX fd for the allocation at base; open: import fd, map
 * size bytes of it on device ordinal with read-write access (handle is
 * what close gives back); close: unmap and release. */
CUresult mcg_cu_vmm_export(struct mcg_cuda *c, CUdeviceptr base, int *fd);
CUresult mcg_cu_vmm_open(struct mcg_cuda *c, int fd, size_t size, int ordinal, CUdeviceptr *p, CUmemGenericAllocationHandle *handle);
CUresult mcg_cu_vmm_close(struct mcg_cuda *c, CUdeviceptr p, size_t size, CUmemGenericAllocationHandle handle);
const char *mcg_cu_error_name(struct mcg_cuda *c, CUresult r);
#endif
