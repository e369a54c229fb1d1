// Host memory that a same-host peer can map: each
// allocation is a sealed shared memory file (memfd) mapped here, so a
// sender on the same host that may already write this process's memory
// (process_vm_writev needs the same permission as pidfd_getfd) maps the
// very pages and copies into them with memcpy: no system call per
// transfer, no page pinning. shared_alloc.go is the owner's side
// (allocate, find, free); shared_attach.go the peer's (map, share, let go).
package samehost

import (
	"fmt"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"
)

// sharedSeals keep the file's size fixed: a peer's mapping can never reach past
// its end (SIGBUS), and nobody can change that afterwards.
const sharedSeals = unix.F_SEAL_SHRINK | unix.F_SEAL_GROW | unix.F_SEAL_SEAL

// SharedFile is one allocation: Len bytes at Addr in this process, the whole of
// the file FD (inode Ino), made for owner.
type SharedFile struct {
	Addr, Len uint64
	FD        int
	Ino       uint64
	mem       []byte
	owner     any
}

// sharedFiles holds this process's allocations by address, for LookupShared.
var sharedFiles = struct {
	sync.Mutex
	byAddr map[uint64]*SharedFile
}{byAddr: map[uint64]*SharedFile{}}

// AllocShared maps n bytes (rounded up to whole pages) of a new sealed memfd,
// zeroed, for owner (which alone finds it with LookupShared).
func AllocShared(n uint64, owner any) (*SharedFile, error) {
	page := uint64(unix.Getpagesize())
	size := (n + page - 1) &^ (page - 1)
	if n == 0 || size < n || size > 1<<47 {
		return nil, fmt.Errorf("cannot allocate %d bytes", n)
	}
	fd, err := unix.MemfdCreate("mcguard-buffer", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, fmt.Errorf("memfd_create: %w", err)
	}
	fail := func(what string, err error) (*SharedFile, error) {
		unix.Close(fd)
		return nil, fmt.Errorf("%s: %w", what, err)
	}
	if err := unix.Ftruncate(fd, int64(size)); err != nil {
		return fail("sizing the shared memory file", err)
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, sharedSeals); err != nil {
		return fail("sealing the shared memory file", err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return fail("fstat", err)
	}
	mem, err := unix.Mmap(fd, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return fail("mmap", err)
	}
	f := &SharedFile{Addr: sharedAddr(mem), Len: size, FD: fd, Ino: st.Ino, mem: mem, owner: owner}
	sharedFiles.Lock()
	sharedFiles.byAddr[f.Addr] = f
	sharedFiles.Unlock()
	return f, nil
}

// Free unmaps the allocation and closes its file. A peer that mapped it
// keeps the pages until it lets go of its mapping; the owner's own use of
// the address ends here.
func (f *SharedFile) Free() error {
	sharedFiles.Lock()
	if sharedFiles.byAddr[f.Addr] != f {
		sharedFiles.Unlock()
		return fmt.Errorf("%#x is not an allocation of this process", f.Addr)
	}
	delete(sharedFiles.byAddr, f.Addr)
	sharedFiles.Unlock()
	err := unix.Munmap(f.mem)
	unix.Close(f.FD)
	return err
}

// LookupShared returns owner's allocation that holds all of [addr, addr+n).
// Another owner's is not found: it may free it while this one still has
// the range registered, and a peer's mapping would then outlive the
// memory at that address.
func LookupShared(addr, n uint64, owner any) (SharedFile, bool) {
	sharedFiles.Lock()
	defer sharedFiles.Unlock()
	for _, f := range sharedFiles.byAddr {
		if f.owner == owner && addr >= f.Addr && addr+n >= addr && addr+n <= f.Addr+f.Len {
			return *f, true
		}
	}
	return SharedFile{}, false
}

func sharedAddr(b []byte) uint64 { return uint64(uintptr(unsafe.Pointer(&b[0]))) }
