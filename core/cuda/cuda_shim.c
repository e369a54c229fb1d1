// Loading libcuda: dlopen, cuInit, cuDriverGetVersion, then every other
// entry point through cuGetProcAddress, all or nothing (NCCL's cudawrap
// does the same). cuFlushGPUDirectRDMAWrites, the dmabuf export and the
// IPC entry points are optional.
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

#include "cuda_shim.h"

#define CUDA_API_VERSION 11030 /* ask for each entry point's ABI as of CUDA 11.3 */

int mcg_cuda_load(const char *path, struct mcg_cuda *c, char *err, size_t errlen) {
    memset(c, 0, sizeof *c);
    c->lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!c->lib) {
        snprintf(err, errlen, "cannot load %s: %s", path, dlerror());
        return -1;
    }
    c->cuInit = (CUresult(*)(unsigned))dlsym(c->lib, "cuInit");
    c->cuDriverGetVersion = (CUresult(*)(int *))dlsym(c->lib, "cuDriverGetVersion");
    c->cuGetProcAddress = (CUresult(*)(const char *, void **, int, unsigned long long))dlsym(c->lib, "cuGetProcAddress");
    if (!c->cuInit || !c->cuDriverGetVersion || !c->cuGetProcAddress) {
        snprintf(err, errlen, "%s lacks cuInit, cuDriverGetVersion or cuGetProcAddress (a driver older than CUDA 11.3?)", path);
        goto fail;
    }
    CUresult r = c->cuInit(0);
    if (r != MCG_CUDA_SUCCESS) {
        snprintf(err, errlen, "cuInit failed with CUresult %d (no GPU, or the driver is not usable)", r);
        goto fail_code;
    }
    if ((r = c->cuDriverGetVersion(&c->driver_version)) != MCG_CUDA_SUCCESS) {
        snprintf(err, errlen, "cuDriverGetVersion failed with CUresult %d", r);
        goto fail_code;
    }
    if (c->driver_version < MCG_CUDA_MIN_DRIVER) {
        snprintf(err, errlen, "the CUDA driver is version %d; mcguard needs %d (CUDA 11.3) or newer",
                 c->driver_version, MCG_CUDA_MIN_DRIVER);
        goto fail;
    }
#define GET_AT(name, version, required)                                                      \
    do {                                                                                     \
        void *p = NULL;                                                                      \
        r = c->cuGetProcAddress(#name, &p, version, 0);                                      \
        if ((r != MCG_CUDA_SUCCESS || !p) && required) {                                     \
            snprintf(err, errlen, "cuGetProcAddress(%s) failed with CUresult %d", #name, r); \
            goto fail;                                                                       \
        }                                                                                    \
        memcpy(&c->name, &p, sizeof p);                                                      \
    } while (0)
#define GET(name, required) GET_AT(name, CUDA_API_VERSION, required)
    GET(cuGetErrorName, 1);
    GET(cuPointerGetAttribute, 1);
    GET(cuDeviceGet, 1);
    GET(cuDevicePrimaryCtxRetain, 1);
    GET(cuCtxSetCurrent, 1);
    GET(cuCtxSynchronize, 1);
    GET(cuStreamCreate, 1);
    GET(cuStreamSynchronize, 1);
    GET(cuMemHostAlloc, 1);
    GET(cuMemFreeHost, 1);
    GET(cuMemcpyDtoHAsync, 1);
    GET(cuMemcpyHtoDAsync, 1);
    GET(cuFlushGPUDirectRDMAWrites, 0);
    GET(cuDeviceGetAttribute, 0);
    GET(cuMemGetAddressRange, 0);
    GET(cuIpcGetMemHandle, 0);
    GET(cuIpcOpenMemHandle, 0);
    GET(cuIpcCloseMemHandle, 0);
    GET(cuMemcpyDtoDAsync, 0);
    GET(cuMemRetainAllocationHandle, 0);
    GET(cuMemExportToShareableHandle, 0);
    GET(cuMemImportFromShareableHandle, 0);
    GET(cuMemRelease, 0);
    GET(cuMemAddressReserve, 0);
    GET(cuMemAddressFree, 0);
    GET(cuMemMap, 0);
    GET(cuMemUnmap, 0);
    GET(cuMemSetAccess, 0);
    if (c->driver_version >= MCG_CUDA_DMABUF_DRIVER) GET_AT(cuMemGetHandleForAddressRange, MCG_CUDA_DMABUF_DRIVER, 0);
#undef GET
#undef GET_AT
    return 0;
fail_code:
    dlclose(c->lib);
    memset(c, 0, sizeof *c);
    return r;
fail:
    dlclose(c->lib);
    memset(c, 0, sizeof *c);
    return -1;
}

CUresult mcg_cu_pointer_get_attribute(struct mcg_cuda *c, void *data, int attr, CUdeviceptr p) {
    return c->cuPointerGetAttribute(data, attr, p);
}

CUresult mcg_cu_device_primary_ctx(struct mcg_cuda *c, int ordinal, CUcontext *ctx) {
    CUdevice dev;
    CUresult r = c->cuDeviceGet(&dev, ordinal);
    if (r != MCG_CUDA_SUCCESS) return r;
    return c->cuDevicePrimaryCtxRetain(ctx, dev);
}

CUresult mcg_cu_ctx_set_current(struct mcg_cuda *c, CUcontext ctx) { return c->cuCtxSetCurrent(ctx); }
CUresult mcg_cu_ctx_synchronize(struct mcg_cuda *c) { return c->cuCtxSynchronize(); }
CUresult mcg_cu_stream_create(struct mcg_cuda *c, CUstream *s) { return c->cuStreamCreate(s, MCG_CU_STREAM_NON_BLOCKING); }
CUresult mcg_cu_stream_synchronize(struct mcg_cuda *c, CUstream s) { return c->cuStreamSynchronize(s); }
CUresult mcg_cu_mem_host_alloc(struct mcg_cuda *c, void **p, size_t n) { return c->cuMemHostAlloc(p, n, MCG_CU_MEMHOSTALLOC_PORTABLE); }
CUresult mcg_cu_mem_free_host(struct mcg_cuda *c, void *p) { return c->cuMemFreeHost(p); }

CUresult mcg_cu_dtoh_async(struct mcg_cuda *c, void *dst, CUdeviceptr src, size_t n, CUstream s) {
    return c->cuMemcpyDtoHAsync(dst, src, n, s);
}

CUresult mcg_cu_htod_async(struct mcg_cuda *c, CUdeviceptr dst, const void *src, size_t n, CUstream s) {
    return c->cuMemcpyHtoDAsync(dst, src, n, s);
}

CUresult mcg_cu_flush_gpudirect(struct mcg_cuda *c) {
    if (!c->cuFlushGPUDirectRDMAWrites) return MCG_CUDA_SUCCESS;
    return c->cuFlushGPUDirectRDMAWrites(MCG_CU_FLUSH_TARGET_CURRENT_CTX, MCG_CU_FLUSH_TO_OWNER);
}

CUresult mcg_cu_dmabuf_supported(struct mcg_cuda *c, int ordinal, int *supported) {
    *supported = 0;
    if (!c->cuDeviceGetAttribute || !c->cuMemGetHandleForAddressRange) return MCG_CUDA_MISSING;
    CUdevice dev;
    CUresult r = c->cuDeviceGet(&dev, ordinal);
    if (r != MCG_CUDA_SUCCESS) return r;
    return c->cuDeviceGetAttribute(supported, MCG_CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, dev);
}

CUresult mcg_cu_mem_get_address_range(struct mcg_cuda *c, CUdeviceptr p, CUdeviceptr *base, size_t *size) {
    if (!c->cuMemGetAddressRange) return MCG_CUDA_MISSING;
    return c->cuMemGetAddressRange(base, size, p);
}

CUresult mcg_cu_mem_get_dmabuf_fd(struct mcg_cuda *c, CUdeviceptr base, size_t size, int *fd) {
    if (!c->cuMemGetHandleForAddressRange) return MCG_CUDA_MISSING;
    return c->cuMemGetHandleForAddressRange(fd, base, size, MCG_CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0);
}

static int has_ipc(struct mcg_cuda *c) {
    return c->cuIpcGetMemHandle && c->cuIpcOpenMemHandle && c->cuIpcCloseMemHandle && c->cuMemcpyDtoDAsync;
}

CUresult mcg_cu_ipc_get(struct mcg_cuda *c, void *handle, CUdeviceptr base) {
    if (!has_ipc(c)) return MCG_CUDA_MISSING;
    return c->cuIpcGetMemHandle((CUipcMemHandle *)handle, base);
}

CUresult mcg_cu_ipc_open(struct mcg_cuda *c, CUdeviceptr *p, const void *handle) {
    if (!has_ipc(c)) return MCG_CUDA_MISSING;
    CUipcMemHandle h;
    memcpy(&h, handle, sizeof h);
    return c->cuIpcOpenMemHandle(p, h, MCG_CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
}

CUresult mcg_cu_ipc_close(struct mcg_cuda *c, CUdeviceptr p) {
    if (!has_ipc(c)) return MCG_CUDA_MISSING;
    return c->cuIpcCloseMemHandle(p);
}

CUresult mcg_cu_dtod_async(struct mcg_cuda *c, CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
    if (!has_ipc(c)) return MCG_CUDA_MISSING;
    return c->cuMemcpyDtoDAsync(dst, src, n, s);
}

static int has_vmm(struct mcg_cuda *c) {
    return c->cuMemRetainAllocationHandle && c->cuMemExportToShareableHandle && c->cuMemImportFromShareableHandle &&
           c->cuMemRelease && c->cuMemAddressReserve && c->cuMemAddressFree && c->cuMemMap && c->cuMemUnmap &&
           c->cuMemSetAccess && c->cuMemcpyDtoDAsync;
}

CUresult mcg_cu_vmm_export(struct mcg_cuda *c, CUdeviceptr base, int *fd) {
    if (!has_vmm(c)) return MCG_CUDA_MISSING;
    CUmemGenericAllocationHandle h;
    CUresult r = c->cuMemRetainAllocationHandle(&h, (void *)(uintptr_t)base);
    if (r != MCG_CUDA_SUCCESS) return r;
    r = c->cuMemExportToShareableHandle(fd, h, MCG_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    c->cuMemRelease(h); /* the retain's reference; the allocation lives on */
    return r;
}

CUresult mcg_cu_vmm_open(struct mcg_cuda *c, int fd, size_t size, int ordinal, CUdeviceptr *p,
                         CUmemGenericAllocationHandle *handle) {
    if (!has_vmm(c)) return MCG_CUDA_MISSING;
    CUresult r = c->cuMemImportFromShareableHandle(handle, (void *)(uintptr_t)fd, MCG_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    if (r != MCG_CUDA_SUCCESS) return r;
    if ((r = c->cuMemAddressReserve(p, size, 0, 0, 0)) != MCG_CUDA_SUCCESS) goto release;
    if ((r = c->cuMemMap(*p, size, 0, *handle, 0)) != MCG_CUDA_SUCCESS) goto free_range;
    CUmemAccessDesc access = {{MCG_CU_MEM_LOCATION_TYPE_DEVICE, ordinal}, MCG_CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    if ((r = c->cuMemSetAccess(*p, size, &access, 1)) != MCG_CUDA_SUCCESS) goto unmap;
    return MCG_CUDA_SUCCESS;
unmap:
    c->cuMemUnmap(*p, size);
free_range:
    c->cuMemAddressFree(*p, size);
release:
    c->cuMemRelease(*handle);
    return r;
}

CUresult mcg_cu_vmm_close(struct mcg_cuda *c, CUdeviceptr p, size_t size, CUmemGenericAllocationHandle handle) {
    if (!has_vmm(c)) return MCG_CUDA_MISSING;
    CUresult r = c->cuMemUnmap(p, size);
    CUresult f = c->cuMemAddressFree(p, size);
    CUresult h = c->cuMemRelease(handle);
    return r != MCG_CUDA_SUCCESS ? r : f != MCG_CUDA_SUCCESS ? f : h;
}

const char *mcg_cu_error_name(struct mcg_cuda *c, CUresult r) {
    const char *name = NULL;
    if (c->cuGetErrorName && c->cuGetErrorName(r, &name) == MCG_CUDA_SUCCESS && name) return name;
    return "unknown CUresult";
}
