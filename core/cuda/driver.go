// Package cuda is mcguard's view of the CUDA driver API: libcuda.so.1 is
// loaded at run time (never linked), pointers are classified, and device
// memory is copied through pinned staging buffers on a stream of ours,
// with the device's primary context current on a locked OS thread.
package cuda

/*
#cgo LDFLAGS: -ldl
#include <stdlib.h>
#include "cuda_shim.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"sync"
	"unsafe"

	"github.com/mcguard/mcguard/core/internal/dl"
)

// ErrUnavailable means there is no usable CUDA driver here.
var ErrUnavailable = errors.New("CUDA driver unavailable")

// ErrDevice marks a failed driver call.
var ErrDevice = errors.New("CUDA call failed")

// DefaultLibrary is what Load opens when no path is given.
const DefaultLibrary = "libcuda.so.1"

// stagingSize is the size of one pinned staging buffer.
const stagingSize = 4 << 20

// Driver is a loaded CUDA driver.
type Driver struct {
	c       *C.struct_mcg_cuda
	Version int

	mu      sync.Mutex
	devices map[int]*device
	staging [][]byte              // free pinned buffers
	exports map[uint64]exported   // IPC handles by allocation base
	vmmMaps map[uint64]vmmMapping // other processes' VMM allocations mapped here, by address
}

type device struct {
	ctx    C.CUcontext
	stream C.CUstream
}

var (
	sharedMu sync.Mutex
	shared   = map[string]*Driver{}
)

// Shared returns the process's driver for path, loading it on first use:
// one symbol table per library, loaded once. A failure is not cached.
func Shared(path string) (*Driver, error) {
	sharedMu.Lock()
	defer sharedMu.Unlock()
	if d, ok := shared[path]; ok {
		return d, nil
	}
	d, err := Load(path)
	if err != nil {
		return nil, err
	}
	shared[path] = d
	return d, nil
}

// Load opens the driver at path (DefaultLibrary if empty).
func Load(path string) (*Driver, error) {
	t, err := dl.Load(path, DefaultLibrary, unsafe.Sizeof(C.struct_mcg_cuda{}), func(path, table, msg unsafe.Pointer, n int) int {
		return int(C.mcg_cuda_load((*C.char)(path), (*C.struct_mcg_cuda)(table), (*C.char)(msg), C.size_t(n)))
	})
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	c := (*C.struct_mcg_cuda)(t)
	return &Driver{c: c, Version: int(c.driver_version), devices: map[int]*device{}, exports: map[uint64]exported{}, vmmMaps: map[uint64]vmmMapping{}}, nil
}

func (d *Driver) check(r C.CUresult, what string) error {
	if r == C.MCG_CUDA_SUCCESS {
		return nil
	}
	return fmt.Errorf("%w: %s: %s (%d)", ErrDevice, what, C.GoString(C.mcg_cu_error_name(d.c, r)), int(r))
}

// Memory says where an address lives.
type Memory struct {
	Device  bool // device memory (copied through staging); false: host memory the CPU reads directly
	Ordinal int
}

// Classify asks the driver what addr is. Memory the driver does not know
// (plain malloc, mmap) is host memory; pinned host memory too.
func (d *Driver) Classify(addr uint64) (Memory, error) {
	var kind C.uint
	r := C.mcg_cu_pointer_get_attribute(d.c, unsafe.Pointer(&kind), C.MCG_CU_POINTER_ATTRIBUTE_MEMORY_TYPE, C.CUdeviceptr(addr))
	if r != C.MCG_CUDA_SUCCESS {
		return Memory{}, nil // CUDA_ERROR_INVALID_VALUE: not CUDA memory, so host memory
	}
	if kind != C.MCG_CU_MEMORYTYPE_DEVICE {
		return Memory{}, nil // host (pinned) or unified: the CPU may touch it
	}
	var ordinal C.int
	r = C.mcg_cu_pointer_get_attribute(d.c, unsafe.Pointer(&ordinal), C.MCG_CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, C.CUdeviceptr(addr))
	if err := d.check(r, "cuPointerGetAttribute(DEVICE_ORDINAL)"); err != nil {
		return Memory{}, err
	}
	return Memory{Device: true, Ordinal: int(ordinal)}, nil
}

// on runs fn with the device's primary context current on this locked
// OS thread (a context is bound to the thread that made it current).
func (d *Driver) on(ordinal int, fn func(dev *device) error) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	d.mu.Lock()
	dev, ok := d.devices[ordinal]
	if !ok {
		dev = &device{}
		if err := d.check(C.mcg_cu_device_primary_ctx(d.c, C.int(ordinal), &dev.ctx), "cuDevicePrimaryCtxRetain"); err != nil {
			d.mu.Unlock()
			return err
		}
		if err := d.check(C.mcg_cu_ctx_set_current(d.c, dev.ctx), "cuCtxSetCurrent"); err != nil {
			d.mu.Unlock()
			return err
		}
		if err := d.check(C.mcg_cu_stream_create(d.c, &dev.stream), "cuStreamCreate"); err != nil {
			d.mu.Unlock()
			return err
		}
		d.devices[ordinal] = dev
	}
	d.mu.Unlock()
	if err := d.check(C.mcg_cu_ctx_set_current(d.c, dev.ctx), "cuCtxSetCurrent"); err != nil {
		return err
	}
	return fn(dev)
}

func (d *Driver) getStaging() ([]byte, error) {
	d.mu.Lock()
	if n := len(d.staging); n > 0 {
		b := d.staging[n-1]
		d.staging = d.staging[:n-1]
		d.mu.Unlock()
		return b, nil
	}
	d.mu.Unlock()
	var p unsafe.Pointer
	if err := d.check(C.mcg_cu_mem_host_alloc(d.c, &p, stagingSize), "cuMemHostAlloc"); err != nil {
		return nil, err
	}
	return unsafe.Slice((*byte)(p), stagingSize), nil
}

func (d *Driver) putStaging(b []byte) {
	d.mu.Lock()
	d.staging = append(d.staging, b)
	d.mu.Unlock()
}

// CopyToHost copies len(dst) bytes of device memory at src into dst.
func (d *Driver) CopyToHost(dst []byte, src uint64, m Memory) error {
	return d.on(m.Ordinal, func(dev *device) error {
		buf, err := d.getStaging()
		if err != nil {
			return err
		}
		defer d.putStaging(buf)
		for off := 0; off < len(dst); off += stagingSize {
			k := min(stagingSize, len(dst)-off)
			if err := d.check(C.mcg_cu_dtoh_async(d.c, unsafe.Pointer(&buf[0]), C.CUdeviceptr(src+uint64(off)), C.size_t(k), dev.stream), "cuMemcpyDtoHAsync"); err != nil {
				return err
			}
			if err := d.check(C.mcg_cu_stream_synchronize(d.c, dev.stream), "cuStreamSynchronize"); err != nil {
				return err
			}
			copy(dst[off:off+k], buf[:k])
		}
		return nil
	})
}

// CopyRangesToHost copies the device ranges [srcs[i], +lens[i]) into
// dst one after another (len(dst) is the sum of lens). The copies are
// queued together and waited for once per staging buffer's worth, not
// once per range: a read-back of many small tails costs one stream
// synchronisation, not one each.
func (d *Driver) CopyRangesToHost(dst []byte, srcs, lens []uint64, m Memory) error {
	return d.on(m.Ordinal, func(dev *device) error {
		buf, err := d.getStaging()
		if err != nil {
			return err
		}
		defer d.putStaging(buf)
		queued, out := 0, 0 // bytes queued into buf; where they go in dst
		drain := func() error {
			if queued == 0 {
				return nil
			}
			if err := d.check(C.mcg_cu_stream_synchronize(d.c, dev.stream), "cuStreamSynchronize"); err != nil {
				return err
			}
			out += copy(dst[out:], buf[:queued])
			queued = 0
			return nil
		}
		for i, src := range srcs {
			for off := uint64(0); off < lens[i]; {
				if queued == stagingSize {
					if err := drain(); err != nil {
						return err
					}
				}
				k := min(lens[i]-off, uint64(stagingSize-queued))
				if err := d.check(C.mcg_cu_dtoh_async(d.c, unsafe.Pointer(&buf[queued]), C.CUdeviceptr(src+off), C.size_t(k), dev.stream), "cuMemcpyDtoHAsync"); err != nil {
					return err
				}
				queued += int(k)
				off += k
			}
		}
		return drain()
	})
}

// CopyToDevice copies src into device memory at dst and returns once the
// copy has completed.
func (d *Driver) CopyToDevice(dst uint64, src []byte, m Memory) error {
	return d.on(m.Ordinal, func(dev *device) error {
		buf, err := d.getStaging()
		if err != nil {
			return err
		}
		defer d.putStaging(buf)
		for off := 0; off < len(src); off += stagingSize {
			k := copy(buf, src[off:])
			if err := d.check(C.mcg_cu_htod_async(d.c, C.CUdeviceptr(dst+uint64(off)), unsafe.Pointer(&buf[0]), C.size_t(k), dev.stream), "cuMemcpyHtoDAsync"); err != nil {
				return err
			}
			if err := d.check(C.mcg_cu_stream_synchronize(d.c, dev.stream), "cuStreamSynchronize"); err != nil {
				return err
			}
		}
		return nil
	})
}

// Settle makes writes to the device's memory visible to its kernels:
// cuFlushGPUDirectRDMAWrites (where the driver has it), then a stream
// synchronisation if the caller names a stream, else a context one.
func (d *Driver) Settle(ordinal int, stream uint64) error {
	return d.on(ordinal, func(dev *device) error {
		if err := d.check(C.mcg_cu_flush_gpudirect(d.c), "cuFlushGPUDirectRDMAWrites"); err != nil {
			return err
		}
		if stream != 0 {
			return d.check(C.mcg_cu_stream_synchronize(d.c, C.CUstream(unsafe.Pointer(uintptr(stream)))), "cuStreamSynchronize")
		}
		return d.check(C.mcg_cu_ctx_synchronize(d.c), "cuCtxSynchronize")
	})
}

// allocation returns the device allocation that holds [addr, addr+n);
// missing is the error to wrap where the driver lacks the entry point.
// Call it with a context current.
func (d *Driver) allocation(addr, n uint64, missing error) (base C.CUdeviceptr, size C.size_t, err error) {
	r := C.mcg_cu_mem_get_address_range(d.c, C.CUdeviceptr(addr), &base, &size)
	if r == C.MCG_CUDA_MISSING {
		return 0, 0, fmt.Errorf("%w: the driver lacks cuMemGetAddressRange", missing)
	}
	if err := d.check(r, "cuMemGetAddressRange"); err != nil {
		return 0, 0, err
	}
	if addr+n > uint64(base)+uint64(size) {
		return 0, 0, fmt.Errorf("%w: [%#x, +%d) is not inside one device allocation", ErrDevice, addr, n)
	}
	return base, size, nil
}

// ErrNoDmabuf: this driver or device cannot export device memory as a
// dmabuf (a driver before CUDA 11.7, or a device that reports
// CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 0).
var ErrNoDmabuf = errors.New("no dmabuf export")

// Dmabuf exports the device allocation that holds [addr, addr+n) as a
// dmabuf file descriptor, for an RDMA registration of that memory
// (ibv_reg_dmabuf_mr). The whole allocation is exported, as NCCL does,
// because the export wants page-aligned bounds; offset is addr's offset
// in it. The caller closes fd once the registration holds its own
// reference.
func (d *Driver) Dmabuf(addr, n uint64, m Memory) (fd int, offset uint64, err error) {
	err = d.on(m.Ordinal, func(*device) error {
		var supported C.int
		switch r := C.mcg_cu_dmabuf_supported(d.c, C.int(m.Ordinal), &supported); {
		case r == C.MCG_CUDA_MISSING:
			return fmt.Errorf("%w: the driver (%d) lacks cuMemGetHandleForAddressRange (CUDA 11.7)", ErrNoDmabuf, d.Version)
		case r != C.MCG_CUDA_SUCCESS:
			return d.check(r, "cuDeviceGetAttribute(DMA_BUF_SUPPORTED)")
		case supported == 0:
			return fmt.Errorf("%w: device %d reports DMA_BUF_SUPPORTED = 0", ErrNoDmabuf, m.Ordinal)
		}
		base, size, err := d.allocation(addr, n, ErrNoDmabuf)
		if err != nil {
			return err
		}
		// The export wants host-page bounds; an allocation is backed in
		// whole pages (of its granularity, 2 MiB), so rounding stays inside.
		pg := uint64(os.Getpagesize())
		lo, hi := uint64(base)&^(pg-1), (uint64(base)+uint64(size)+pg-1)&^(pg-1)
		var cfd C.int
		if err := d.check(C.mcg_cu_mem_get_dmabuf_fd(d.c, C.CUdeviceptr(lo), C.size_t(hi-lo), &cfd), "cuMemGetHandleForAddressRange(DMA_BUF_FD)"); err != nil {
			return err
		}
		fd, offset = int(cfd), addr-lo
		return nil
	})
	return fd, offset, err
}
