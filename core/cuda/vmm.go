package cuda

/*
#include "cuda_shim.h"
*/
import "C"

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"os"
	"unsafe"

	"golang.org/x/sys/unix"
)

// VMM memory (cuMemCreate: PyTorch's expandable segments, vLLM's sleep-mode
// allocator) has no legacy IPC handle. Where the allocation allows a POSIX
// file descriptor as its shareable handle, the exporter hands out a
// reference that names its pid, that descriptor (kept open while the
// export is cached), the allocation's size and its buffer id; the importer
// takes its own copy of the descriptor with pidfd_getfd (the same ptrace
// access a same-host transfer needs anyway), imports it, reserves an
// address range, maps the allocation and grants its device read-write
// access. The reference travels in an IPCRef's handle, told from a legacy
// handle by a 16-byte mark.

var vmmMark = []byte("mcguard-vmm-fd\x00\x01")

// vmmRef is what a VMM reference names.
type vmmRef struct {
	pid, fd  int
	size, id uint64
}

func (v vmmRef) handle() (h [IPCHandleSize]byte) {
	copy(h[:], vmmMark)
	binary.LittleEndian.PutUint32(h[16:], uint32(v.pid))
	binary.LittleEndian.PutUint32(h[20:], uint32(v.fd))
	binary.LittleEndian.PutUint64(h[24:], v.size)
	binary.LittleEndian.PutUint64(h[32:], v.id)
	return h
}

func parseVMM(h [IPCHandleSize]byte) (vmmRef, bool) {
	if !bytes.Equal(h[:len(vmmMark)], vmmMark) {
		return vmmRef{}, false
	}
	return vmmRef{pid: int(binary.LittleEndian.Uint32(h[16:])), fd: int(binary.LittleEndian.Uint32(h[20:])),
		size: binary.LittleEndian.Uint64(h[24:]), id: binary.LittleEndian.Uint64(h[32:])}, true
}

// HandleProcess is the process a reference's handle says exported it, for
// a VMM reference (whose importer takes the descriptor from that process);
// 0 for a legacy handle. A receiver checks it against the sender it proved.
func HandleProcess(h [IPCHandleSize]byte) int {
	v, ok := parseVMM(h)
	if !ok {
		return 0
	}
	return v.pid
}

// exportVMM exports the VMM allocation at base (size bytes, buffer id),
// or says why it cannot be shared.
func (d *Driver) exportVMM(base C.CUdeviceptr, size, id uint64) exported {
	e := exported{id: id, fd: -1}
	var types C.ulonglong // documented as 4 bytes; 8 zeroed ones read the same either way
	r := C.mcg_cu_pointer_get_attribute(d.c, unsafe.Pointer(&types), C.MCG_CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES, base)
	if r != C.MCG_CUDA_SUCCESS || types&C.MCG_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR == 0 {
		e.err = fmt.Errorf("%w: the allocation at %#x has no legacy IPC handle and was not created shareable as a file descriptor (VMM memory without requestedHandleTypes)", ErrNoIPC, uint64(base))
		return e
	}
	var fd C.int
	switch r := C.mcg_cu_vmm_export(d.c, base, &fd); {
	case r == C.MCG_CUDA_MISSING:
		e.err = fmt.Errorf("%w: the driver lacks the VMM sharing entry points", ErrNoIPC)
		return e
	case r != C.MCG_CUDA_SUCCESS:
		e.err = fmt.Errorf("%w: %v", ErrNoIPC, d.check(r, "cuMemExportToShareableHandle"))
		return e
	}
	e.fd = int(fd)
	e.handle = vmmRef{pid: os.Getpid(), fd: e.fd, size: size, id: id}.handle()
	return e
}

// vmmMapping is a VMM allocation of another process mapped here.
type vmmMapping struct {
	size   uint64
	handle C.CUmemGenericAllocationHandle
}

// openVMM maps the allocation a VMM reference names into device ordinal.
func (d *Driver) openVMM(v vmmRef, ordinal int) (ptr, size uint64, err error) {
	pidfd, err := unix.PidfdOpen(v.pid, 0)
	if err != nil {
		return 0, 0, fmt.Errorf("%w: pidfd_open(%d): %v", ErrNoIPC, v.pid, err)
	}
	defer unix.Close(pidfd)
	fd, err := unix.PidfdGetfd(pidfd, v.fd, 0)
	if err != nil {
		return 0, 0, fmt.Errorf("%w: pidfd_getfd of the sender's allocation: %v", ErrNoIPC, err)
	}
	defer unix.Close(fd) // the import holds its own reference
	var p C.CUdeviceptr
	var h C.CUmemGenericAllocationHandle
	r := C.mcg_cu_vmm_open(d.c, C.int(fd), C.size_t(v.size), C.int(ordinal), &p, &h)
	if r == C.MCG_CUDA_MISSING {
		return 0, 0, fmt.Errorf("%w: the driver lacks the VMM sharing entry points", ErrNoIPC)
	}
	if err := d.check(r, "importing and mapping a VMM allocation"); err != nil {
		return 0, 0, err
	}
	d.mu.Lock()
	d.vmmMaps[uint64(p)] = vmmMapping{size: v.size, handle: h}
	d.mu.Unlock()
	return uint64(p), v.size, nil
}

// closeVMM unmaps what openVMM mapped at ptr; false if it did not.
func (d *Driver) closeVMM(ptr uint64) (bool, error) {
	d.mu.Lock()
	m, ok := d.vmmMaps[ptr]
	delete(d.vmmMaps, ptr)
	d.mu.Unlock()
	if !ok {
		return false, nil
	}
	return true, d.check(C.mcg_cu_vmm_close(d.c, C.CUdeviceptr(ptr), C.size_t(m.size), m.handle), "unmapping a VMM allocation")
}
