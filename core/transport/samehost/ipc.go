package samehost

import (
	"fmt"
	"sync"

	"github.com/mcguard/mcguard/core/cuda"
	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/core/logs"
)

// The CUDA IPC mappings a target keeps of its same-host senders' GPU
// allocations, shared by their connections.

// IPC mapping bounds: per sender process and in all. Past them the least
// recently used idle mapping is closed (and opened again if needed).
const (
	maxIPCMapsPerSender = 64
	maxIPCMaps          = 1024
)

// IPCKey names a sender's allocation: its IPC handle, and the device it
// is open on here.
type IPCKey struct {
	Handle  [cuda.IPCHandleSize]byte
	Ordinal int
}

// IPCMap is a sender's allocation opened here.
type IPCMap struct {
	key       IPCKey
	pid       int
	Ptr, Size uint64 // where it is mapped here
	users     int    // writes copying from it now
	used      uint64 // when last used (a tick), for eviction
}

// IPCOpener opens and closes IPC handles: the CUDA driver.
type IPCOpener interface {
	OpenIPC(h [cuda.IPCHandleSize]byte, ordinal int) (ptr, size uint64, err error)
	CloseIPC(ptr uint64, ordinal int) error
}

// IPCMaps are the allocations a target opened: a handle may be opened only
// once per process, so connections share them.
type IPCMaps struct {
	mu   sync.Mutex
	m    map[IPCKey]*IPCMap
	tick uint64
}

// Acquire returns the mapping of key for a write from process pid, opening
// it if needed; release it after the copy.
func (s *IPCMaps) Acquire(gpu IPCOpener, pid int, key IPCKey) (*IPCMap, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.tick++
	if m, ok := s.m[key]; ok && m.pid == pid {
		m.users++
		m.used = s.tick
		return m, nil
	} else if ok {
		return nil, fmt.Errorf("%w: the handle is open for another sender process", errs.Peer)
	}
	if s.m == nil {
		s.m = map[IPCKey]*IPCMap{}
	}
	mine := 0
	for _, m := range s.m {
		if m.pid == pid {
			mine++
		}
	}
	if mine >= maxIPCMapsPerSender && !s.evict(gpu, pid) || len(s.m) >= maxIPCMaps && !s.evict(gpu, 0) {
		return nil, fmt.Errorf("%w: every CUDA IPC mapping this receiver may keep is in use", errs.Peer)
	}
	ptr, size, err := gpu.OpenIPC(key.Handle, key.Ordinal)
	if err != nil {
		return nil, err
	}
	m := &IPCMap{key: key, pid: pid, Ptr: ptr, Size: size, users: 1, used: s.tick}
	s.m[key] = m
	return m, nil
}

// evict closes the least recently used idle mapping (of process pid, if
// not 0); false if there is none.
func (s *IPCMaps) evict(gpu IPCOpener, pid int) bool {
	var lru *IPCMap
	for _, m := range s.m {
		if m.users == 0 && (pid == 0 || m.pid == pid) && (lru == nil || m.used < lru.used) {
			lru = m
		}
	}
	if lru == nil {
		return false
	}
	s.closeLocked(gpu, lru)
	return true
}

func (s *IPCMaps) closeLocked(gpu IPCOpener, m *IPCMap) {
	delete(s.m, m.key)
	if err := gpu.CloseIPC(m.Ptr, m.key.Ordinal); err != nil {
		logs.Printf(logs.Info, "target: %v", err)
	}
}

// Release ends a write's use of m (Acquire).
func (s *IPCMaps) Release(m *IPCMap) {
	s.mu.Lock()
	m.users--
	s.mu.Unlock()
}

// Drop closes the idle mappings of process pid (0: all of them), so that
// a sender gone does not keep its GPU memory mapped here.
func (s *IPCMaps) Drop(gpu IPCOpener, pid int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, m := range s.m {
		if m.users == 0 && (pid == 0 || m.pid == pid) {
			s.closeLocked(gpu, m)
		}
	}
}

// Count is how many mappings are open (for tests).
func (s *IPCMaps) Count() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.m)
}
