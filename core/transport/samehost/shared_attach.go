package samehost

import (
	"fmt"
	"sync"

	"golang.org/x/sys/unix"
)

// SharedMapping is a peer's allocation mapped into this process. Every
// connection of this process to that peer shares one mapping (one set of
// page tables to fill), until the last lets go of it.
type SharedMapping struct {
	Mem  []byte
	key  sharedKey
	refs int
}

// sharedKey names a peer's file: its descriptor in the peer's process and its
// inode. A mapping keeps its inode alive, so no other file takes the
// number while the mapping is here.
type sharedKey struct {
	pid, fd int
	ino     uint64
}

var sharedMappings = struct {
	sync.Mutex
	byKey map[sharedKey]*SharedMapping
}{byKey: map[sharedKey]*SharedMapping{}}

// AttachShared maps the allocation that process pid holds as descriptor fd and
// says is inode ino of size bytes. Taking a copy of the descriptor
// (pidfd_getfd) needs the same permission as writing the process's
// memory; the copy must be the inode named, sealed against shrinking, and
// of that size, or nothing is mapped.
func AttachShared(pid, fd int, ino, size uint64) (*SharedMapping, error) {
	key := sharedKey{pid, fd, ino}
	sharedMappings.Lock()
	defer sharedMappings.Unlock()
	if m := sharedMappings.byKey[key]; m != nil {
		if uint64(len(m.Mem)) != size { // sealed: its size cannot have changed
			return nil, fmt.Errorf("descriptor %d of process %d is not the shared buffer its table names", fd, pid)
		}
		m.refs++
		return m, nil
	}
	pidfd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return nil, fmt.Errorf("pidfd_open: %w", err)
	}
	own, err := unix.PidfdGetfd(pidfd, fd, 0)
	unix.Close(pidfd)
	if err != nil {
		return nil, fmt.Errorf("pidfd_getfd: %w", err)
	}
	defer unix.Close(own)
	var st unix.Stat_t
	if err := unix.Fstat(own, &st); err != nil {
		return nil, fmt.Errorf("fstat: %w", err)
	}
	if st.Ino != ino || st.Size < 0 || uint64(st.Size) != size || size == 0 || size > 1<<47 {
		return nil, fmt.Errorf("descriptor %d of process %d is not the shared buffer its table names", fd, pid)
	}
	got, err := unix.FcntlInt(uintptr(own), unix.F_GET_SEALS, 0)
	if err != nil || got&unix.F_SEAL_SHRINK == 0 {
		return nil, fmt.Errorf("descriptor %d of process %d is not sealed against shrinking", fd, pid)
	}
	mem, err := unix.Mmap(own, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("mmap: %w", err)
	}
	m := &SharedMapping{Mem: mem, key: key, refs: 1}
	sharedMappings.byKey[key] = m
	return m, nil
}

// Release lets go of a mapping; the last holder unmaps it, which frees the
// peer's pages if it freed them too.
func (m *SharedMapping) Release() {
	sharedMappings.Lock()
	defer sharedMappings.Unlock()
	m.refs--
	if m.refs > 0 {
		return
	}
	delete(sharedMappings.byKey, m.key)
	unix.Munmap(m.Mem)
	m.Mem = nil
}

// SharedMapped counts this process's sharedMappings of peers' allocations.
func SharedMapped() int {
	sharedMappings.Lock()
	defer sharedMappings.Unlock()
	return len(sharedMappings.byKey)
}
