package tcp

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"sync"

	"github.com/mcguard/mcguard/core/cuda"
	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/core/logs"
	"github.com/mcguard/mcguard/core/memory"
	"github.com/mcguard/mcguard/core/transport"
	"github.com/mcguard/mcguard/core/wire"
)

// Same-host GPU memory: where both guards have a CUDA driver, a write out
// of the sender's device memory goes as its allocation's IPC handle and
// offset (OpWriteFromDevice), and the target copies device to device on a
// stream of its own, acknowledging after the copy completed. Everything
// else is the same-host path's: only a connection that proved it comes
// from the sending process may name sources, and the rest of the write is
// the TCP target's.

// IPC mapping bounds: per sender process and in all. Past them the least
// recently used idle mapping is closed (and opened again if needed).
const (
	maxIPCMapsPerSender = 64
	maxIPCMaps          = 1024
)

type ipcKey struct {
	handle  [cuda.IPCHandleSize]byte
	ordinal int // the device it is open on here
}

// ipcMap is a sender's allocation opened here.
type ipcMap struct {
	key       ipcKey
	pid       int
	ptr, size uint64
	users     int    // writes copying from it now
	used      uint64 // when last used (a tick), for eviction
}

// ipcOpener opens and closes IPC handles: the CUDA driver.
type ipcOpener interface {
	OpenIPC(h [cuda.IPCHandleSize]byte, ordinal int) (ptr, size uint64, err error)
	CloseIPC(ptr uint64, ordinal int) error
}

// ipcMaps are the allocations a target opened: a handle may be opened only
// once per process, so connections share them.
type ipcMaps struct {
	mu   sync.Mutex
	m    map[ipcKey]*ipcMap
	tick uint64
}

// acquire returns the mapping of key for a write from process pid, opening
// it if needed; release it after the copy.
func (s *ipcMaps) acquire(gpu ipcOpener, pid int, key ipcKey) (*ipcMap, error) {
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
		s.m = map[ipcKey]*ipcMap{}
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
	ptr, size, err := gpu.OpenIPC(key.handle, key.ordinal)
	if err != nil {
		return nil, err
	}
	m := &ipcMap{key: key, pid: pid, ptr: ptr, size: size, users: 1, used: s.tick}
	s.m[key] = m
	return m, nil
}

// evict closes the least recently used idle mapping (of process pid, if
// not 0); false if there is none.
func (s *ipcMaps) evict(gpu ipcOpener, pid int) bool {
	var lru *ipcMap
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

func (s *ipcMaps) closeLocked(gpu ipcOpener, m *ipcMap) {
	delete(s.m, m.key)
	if err := gpu.CloseIPC(m.ptr, m.key.ordinal); err != nil {
		logs.Printf(logs.Info, "target: %v", err)
	}
}

func (s *ipcMaps) release(m *ipcMap) {
	s.mu.Lock()
	m.users--
	s.mu.Unlock()
}

// drop closes the idle mappings of process pid (0: all of them), so that
// a sender gone does not keep its GPU memory mapped here.
func (s *ipcMaps) drop(gpu ipcOpener, pid int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, m := range s.m {
		if m.users == 0 && (pid == 0 || m.pid == pid) {
			s.closeLocked(gpu, m)
		}
	}
}

// count is how many mappings are open (for tests).
func (s *ipcMaps) count() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.m)
}

// ipcSource is [ptr, ptr+n) of a sender's allocation opened here.
type ipcSource struct {
	t   *target
	m   *ipcMap
	ptr uint64
	n   uint64
	mem cuda.Memory
}

// fill stages the bytes into host memory (fault injection's buffer).
func (s ipcSource) fill(b []byte) error {
	if err := s.t.regions.GPU().CopyToHost(b, s.ptr, s.mem); err != nil {
		return fmt.Errorf("%w: copying from the peer's GPU memory: %v", errs.Device, err)
	}
	s.t.ipcBytes.Add(int64(len(b)))
	return nil
}

func (ipcSource) discard() error { return nil }

// store copies the bytes into place device to device (or to host memory).
func (s ipcSource) store(r *memory.Regions, addr, n uint64, cut func()) error {
	if err := r.StoreFromDevice(addr, n, cut, s.ptr, s.mem); err != nil {
		return err
	}
	s.t.ipcBytes.Add(int64(n))
	return nil
}

func (s ipcSource) release() { s.t.ipcs.release(s.m) }

// pullDevice decodes a WriteFromDevice frame into dst and opens its
// source, on a connection that proved it comes from a same-host sender.
func (t *target) pullDevice(l *link, r io.Reader, dst, n uint64) (ipcSource, wire.Status, error) {
	if n != wire.IPCRefSize {
		_, err := io.CopyN(io.Discard, r, int64(n))
		return ipcSource{}, wire.StatusBadRequest, err
	}
	var ref [wire.IPCRefSize]byte
	if _, err := io.ReadFull(r, ref[:]); err != nil {
		return ipcSource{}, 0, err
	}
	var key ipcKey
	copy(key.handle[:], ref[:cuda.IPCHandleSize])
	off := binary.LittleEndian.Uint64(ref[cuda.IPCHandleSize:])
	size := binary.LittleEndian.Uint64(ref[cuda.IPCHandleSize+8:])
	gpu := t.regions.GPU()
	// A VMM reference names the process whose descriptor the target takes:
	// only the sender this connection proved to be.
	if pid := cuda.HandleProcess(key.handle); l.pid == 0 || gpu == nil || size == 0 || size > transport.MaxSlice || pid != 0 && pid != l.pid {
		return ipcSource{}, wire.StatusBadRequest, nil
	}
	mem, err := t.regions.Memory(dst, size)
	if err != nil {
		return ipcSource{}, wire.StatusNotRegistered, nil
	}
	key.ordinal = mem.Ordinal // host memory: device 0
	m, err := t.ipcs.acquire(gpu, l.pid, key)
	if err != nil {
		logs.Printf(logs.Info, "target: cannot open the sender's CUDA IPC handle (its GPU bytes come through the socket from its next connection on): %v", err)
		t.grants.RefuseIPC(l.sender)
		return ipcSource{}, wire.StatusNoAccess, nil
	}
	src := ipcSource{t: t, m: m, ptr: m.ptr + off, n: size, mem: cuda.Memory{Device: true, Ordinal: key.ordinal}}
	if off > m.size || size > m.size-off {
		src.release()
		return ipcSource{}, wire.StatusBadRequest, nil
	}
	return src, wire.StatusOK, nil
}

// sendDevice sends a device-memory slice as its IPC reference, if this
// connection uses CUDA IPC and the allocation has a handle; false if it
// must be staged instead.
func (t *conn) sendDevice(sl transport.Slice, mem cuda.Memory, m wire.Status) (bool, error) {
	if !t.ipc {
		return false, nil
	}
	ref, err := t.local.GPU().ExportIPC(sl.Src, sl.Len, mem)
	if errors.Is(err, cuda.ErrNoIPC) {
		ipcFallback.Printf(logs.Info, "same-host GPU transfers staged through the socket, not CUDA IPC: %v", err)
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("%w: %v", errs.Device, err)
	}
	var p [wire.IPCRefSize]byte
	copy(p[:], ref.Handle[:])
	binary.LittleEndian.PutUint64(p[cuda.IPCHandleSize:], ref.Offset)
	binary.LittleEndian.PutUint64(p[cuda.IPCHandleSize+8:], sl.Len)
	return true, t.send(wire.Header{Op: wire.OpWriteFromDevice, Status: m, Addr: sl.Dst, Len: uint64(len(p))}, p[:])
}
