package cuda

/*
#include "cuda_shim.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"unsafe"

	"golang.org/x/sys/unix"
)

// CUDA IPC, for GPU-to-GPU copies between two processes on one host: the
// sender exports the allocation that holds its source (cuIpcGetMemHandle),
// the receiver opens it once (cuIpcOpenMemHandle) and copies device to
// device on a stream of its own, over NVLink or PCIe peer access. Only
// cuMemAlloc'd memory has legacy IPC handles; memory from the VMM API
// (cuMemCreate: PyTorch's expandable segments) has none: it goes by its
// shareable file descriptor where it has one (vmm.go), else it is staged.

// IPCHandleSize is CU_IPC_HANDLE_SIZE.
const IPCHandleSize = C.MCG_CU_IPC_HANDLE_SIZE

// ErrNoIPC: this driver or this allocation cannot be shared by CUDA IPC.
var ErrNoIPC = errors.New("no CUDA IPC")

// IPCRef names device bytes for another process: the handle of the
// allocation that holds them and their offset in it.
type IPCRef struct {
	Handle [IPCHandleSize]byte
	Offset uint64
}

// exported is a cached export: the allocation's buffer id (a process-wide
// unique id, so a freed and reallocated base is told apart) and its
// handle, or why it has none.
type exported struct {
	id     uint64
	handle [IPCHandleSize]byte
	fd     int // a VMM export's descriptor, open while cached; -1: none
	err    error
}

// forget closes what the export holds.
func (e exported) forget() {
	if e.fd >= 0 {
		unix.Close(e.fd)
	}
}

// maxExports bounds the export cache; past it the cache starts again
// (an export costs one driver call).
const maxExports = 4096

// ExportIPC returns the reference of device bytes [addr, addr+n).
func (d *Driver) ExportIPC(addr, n uint64, m Memory) (IPCRef, error) {
	var ref IPCRef
	err := d.on(m.Ordinal, func(*device) error {
		base, size, err := d.allocation(addr, n, ErrNoIPC)
		if err != nil {
			return err
		}
		var id C.ulonglong
		if err := d.check(C.mcg_cu_pointer_get_attribute(d.c, unsafe.Pointer(&id), C.MCG_CU_POINTER_ATTRIBUTE_BUFFER_ID, base), "cuPointerGetAttribute(BUFFER_ID)"); err != nil {
			return err
		}
		d.mu.Lock()
		e, ok := d.exports[uint64(base)]
		d.mu.Unlock()
		if !ok || e.id != uint64(id) {
			e = d.export(base, uint64(size), uint64(id))
			d.mu.Lock()
			if old, ok := d.exports[uint64(base)]; ok { // freed and allocated again
				old.forget()
			}
			if len(d.exports) >= maxExports {
				for _, x := range d.exports {
					x.forget()
				}
				clear(d.exports)
			}
			d.exports[uint64(base)] = e
			d.mu.Unlock()
		}
		if e.err != nil {
			return e.err
		}
		ref = IPCRef{Handle: e.handle, Offset: addr - uint64(base)}
		return nil
	})
	return ref, err
}

// export asks the driver for base's handle (a VMM reference for memory
// without a legacy one), or says why there is none.
func (d *Driver) export(base C.CUdeviceptr, size, id uint64) exported {
	e := exported{id: id, fd: -1}
	var capable C.int
	r := C.mcg_cu_pointer_get_attribute(d.c, unsafe.Pointer(&capable), C.MCG_CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, base)
	if r == C.MCG_CUDA_SUCCESS && capable == 0 {
		return d.exportVMM(base, size, id)
	}
	switch r := C.mcg_cu_ipc_get(d.c, unsafe.Pointer(&e.handle[0]), base); {
	case r == C.MCG_CUDA_MISSING:
		e.err = fmt.Errorf("%w: the driver lacks the IPC entry points", ErrNoIPC)
	case r != C.MCG_CUDA_SUCCESS:
		e.err = fmt.Errorf("%w: %v", ErrNoIPC, d.check(r, "cuIpcGetMemHandle"))
	}
	return e
}

// OpenIPC maps another process's allocation into device ordinal's
// context: its address here and its size. A handle may be open only once
// per process; the caller keeps what it opened.
func (d *Driver) OpenIPC(h [IPCHandleSize]byte, ordinal int) (ptr, size uint64, err error) {
	err = d.on(ordinal, func(*device) error {
		if v, ok := parseVMM(h); ok {
			ptr, size, err = d.openVMM(v, ordinal)
			return err
		}
		var p C.CUdeviceptr
		r := C.mcg_cu_ipc_open(d.c, &p, unsafe.Pointer(&h[0]))
		if r == C.MCG_CUDA_MISSING {
			return fmt.Errorf("%w: the driver lacks the IPC entry points", ErrNoIPC)
		}
		if err := d.check(r, "cuIpcOpenMemHandle"); err != nil {
			return err
		}
		var base C.CUdeviceptr
		var n C.size_t
		if err := d.check(C.mcg_cu_mem_get_address_range(d.c, p, &base, &n), "cuMemGetAddressRange"); err != nil {
			C.mcg_cu_ipc_close(d.c, p)
			return err
		}
		ptr, size = uint64(p), uint64(base)+uint64(n)-uint64(p)
		return nil
	})
	return ptr, size, err
}

// CloseIPC unmaps what OpenIPC mapped.
func (d *Driver) CloseIPC(ptr uint64, ordinal int) error {
	return d.on(ordinal, func(*device) error {
		if vmm, err := d.closeVMM(ptr); vmm {
			return err
		}
		return d.check(C.mcg_cu_ipc_close(d.c, C.CUdeviceptr(ptr)), "cuIpcCloseMemHandle")
	})
}

// CopyDeviceToDevice copies n bytes from src to dst (dst on device
// m.Ordinal) on that device's stream and returns once the copy completed.
func (d *Driver) CopyDeviceToDevice(dst, src, n uint64, m Memory) error {
	return d.on(m.Ordinal, func(dev *device) error {
		r := C.mcg_cu_dtod_async(d.c, C.CUdeviceptr(dst), C.CUdeviceptr(src), C.size_t(n), dev.stream)
		if r == C.MCG_CUDA_MISSING {
			return fmt.Errorf("%w: the driver lacks cuMemcpyDtoDAsync", ErrNoIPC)
		}
		if err := d.check(r, "cuMemcpyDtoDAsync"); err != nil {
			return err
		}
		return d.check(C.mcg_cu_stream_synchronize(d.c, dev.stream), "cuStreamSynchronize")
	})
}
