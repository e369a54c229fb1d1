package rdma

/*
#include <stdlib.h>
#include "qp_shim.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"sync"
	"syscall"
	"time"
	"unsafe"
)

// ErrCompletion marks a work request that completed in error.
var ErrCompletion = errors.New("RDMA work request failed")

// Endpoint is an opened device port with a protection domain; each of its
// queue pairs has a completion queue of its own.
type Endpoint struct {
	ep  *C.struct_mcg_endpoint
	mu  sync.Mutex // guards mrs
	mrs map[uint64]*MR
}

// MR is a registered memory region.
type MR struct {
	Addr, Len  uint64
	LKey, RKey uint32
	mr         *C.struct_ibv_mr
}

// Open opens device (empty: the first with an active port) with the GID at
// gidIndex (-1: the first RoCE v2 GID where the library tells GID types).
func (v *Verbs) Open(device string, gidIndex int) (*Endpoint, error) {
	ep := (*C.struct_mcg_endpoint)(C.calloc(1, C.size_t(unsafe.Sizeof(C.struct_mcg_endpoint{}))))
	var cdev *C.char
	if device != "" {
		cdev = C.CString(device)
		defer C.free(unsafe.Pointer(cdev))
	}
	var msg [256]C.char
	if C.mcg_ep_open(v.v, cdev, C.int(gidIndex), ep, &msg[0], C.size_t(len(msg))) != 0 {
		C.free(unsafe.Pointer(ep))
		return nil, fmt.Errorf("%w: %s", ErrNoDevice, C.GoString(&msg[0]))
	}
	return &Endpoint{ep: ep, mrs: map[uint64]*MR{}}, nil
}

// Close releases the endpoint's device resources.
func (e *Endpoint) Close() {
	C.mcg_ep_close(e.ep)
	C.free(unsafe.Pointer(e.ep))
}

// GID is this endpoint's port GID.
func (e *Endpoint) GID() [16]byte {
	var g [16]byte
	copy(g[:], C.GoBytes(unsafe.Pointer(&e.ep.gid), 16))
	return g
}

// Register registers [addr, addr+n) for local and remote access.
func (e *Endpoint) Register(addr, n uint64) (*MR, error) {
	mr := C.mcg_ep_reg(e.ep, unsafe.Pointer(uintptr(addr)), C.size_t(n))
	if mr == nil {
		return nil, fmt.Errorf("ibv_reg_mr(%#x, %d) failed", addr, n)
	}
	m := &MR{Addr: addr, Len: n, LKey: uint32(C.mcg_mr_lkey(mr)), RKey: uint32(C.mcg_mr_rkey(mr)), mr: mr}
	e.mu.Lock()
	e.mrs[addr] = m
	e.mu.Unlock()
	return m, nil
}

// Deregister releases mr.
func (e *Endpoint) Deregister(m *MR) {
	e.mu.Lock()
	delete(e.mrs, m.Addr)
	e.mu.Unlock()
	C.mcg_ep_dereg(e.ep, m.mr)
}

// local returns the lkey of the registered region holding [addr, addr+n):
// a local range outside registered memory is refused before posting.
func (e *Endpoint) local(addr, n uint64) (uint32, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, m := range e.mrs {
		if addr >= m.Addr && addr+n <= m.Addr+m.Len && addr+n >= addr {
			return m.LKey, nil
		}
	}
	return 0, fmt.Errorf("local range [%#x, +%d) is not in a registered memory region", addr, n)
}

// QPInfo is what a peer needs to connect to a queue pair.
type QPInfo struct {
	QPN uint32   `json:"qpn"`
	GID [16]byte `json:"gid"`
	PSN uint32   `json:"psn"`
}

// QP is a reliable-connected queue pair; it remembers its peer so that
// it can be reset and reconnected after an error.
type QP struct {
	e      *Endpoint
	qp     *C.struct_ibv_qp
	depth  int
	psn    uint32
	remote QPInfo
	nextID uint64
}

// NewQP creates a queue pair of the given send depth.
func (e *Endpoint) NewQP(depth int) (*QP, error) {
	qp := C.mcg_qp_create(e.ep, C.int(depth))
	if qp == nil {
		return nil, fmt.Errorf("ibv_create_qp failed")
	}
	return &QP{e: e, qp: qp, depth: depth, psn: uint32(time.Now().UnixNano()) & 0xffffff}, nil
}

// Info describes the queue pair for its peer.
func (q *QP) Info() QPInfo {
	return QPInfo{QPN: uint32(C.mcg_qp_num(q.qp)), GID: q.e.GID(), PSN: q.psn}
}

// Connect takes the queue pair through INIT, RTR and RTS to remote.
func (q *QP) Connect(remote QPInfo) error {
	gid := remote.GID
	if r := C.mcg_qp_connect(q.e.ep, q.qp, C.uint32_t(remote.QPN), (*C.uint8_t)(unsafe.Pointer(&gid[0])), C.uint32_t(q.psn), C.uint32_t(remote.PSN)); r != 0 {
		return fmt.Errorf("connecting the queue pair: %v", syscall.Errno(r))
	}
	q.remote = remote
	return nil
}

// Reconnect resets the queue pair, drops the completions its failed work
// left behind, and connects it to the same peer again.
func (q *QP) Reconnect() error {
	if r := C.mcg_qp_reset(q.e.ep, q.qp); r != 0 {
		return fmt.Errorf("resetting the queue pair: %v", syscall.Errno(r))
	}
	q.drain()
	return q.Connect(q.remote)
}

func (q *QP) drain() {
	var ids [64]C.uint64_t
	var sts [64]C.int
	for C.mcg_poll(q.qp, 64, &ids[0], &sts[0]) > 0 {
	}
}

// Destroy releases the queue pair.
func (q *QP) Destroy() { C.mcg_qp_destroy(q.e.ep, q.qp) }

// Write is one RDMA WRITE: Len bytes from local Addr to the peer's
// RemoteAddr under RKey.
type Write struct {
	Addr, RemoteAddr, Len uint64
	RKey                  uint32
}

// Writes posts the writes as chains of at most the queue depth, signalling
// every half depth and the last, and waits for their completions. A
// completion means the peer NIC accepted them — not that the bytes are
// visible there: that takes a fence (Read on this QP).
func (q *QP) Writes(ws []Write, timeout time.Duration) error {
	n := len(ws)
	if n == 0 {
		return nil
	}
	la, lk := make([]uint64, n), make([]uint32, n)
	ra, rk, ln := make([]uint64, n), make([]uint32, n), make([]uint32, n)
	for i, w := range ws {
		key, err := q.e.local(w.Addr, w.Len)
		if err != nil {
			return err
		}
		if w.Len > 1<<31 {
			return fmt.Errorf("write %d of %d bytes: slice it", i, w.Len)
		}
		la[i], lk[i], ra[i], rk[i], ln[i] = w.Addr, key, w.RemoteAddr, w.RKey, uint32(w.Len)
	}
	every := max(1, q.depth/2)
	for start := 0; start < n; start += q.depth {
		k := min(q.depth, n-start)
		base := q.nextID
		q.nextID += uint64(k)
		signaled := (k + every - 1) / every // every every-th, and the last
		if r := C.mcg_post_writes(q.qp, C.int(k), (*C.uint64_t)(&la[start]), (*C.uint32_t)(&lk[start]), (*C.uint64_t)(&ra[start]),
			(*C.uint32_t)(&rk[start]), (*C.uint32_t)(&ln[start]), C.uint64_t(base), C.int(every)); r != 0 {
			return fmt.Errorf("%w: ibv_post_send: %v", ErrCompletion, syscall.Errno(r))
		}
		if err := q.wait(signaled, timeout); err != nil {
			return err
		}
	}
	return nil
}

// Read reads n bytes of the peer's memory into local addr. Answered after
// every earlier write on this QP is visible at the peer: the fence.
func (q *QP) Read(addr, remote uint64, rkey uint32, n uint64, timeout time.Duration) error {
	key, err := q.e.local(addr, n)
	if err != nil {
		return err
	}
	id := q.nextID
	q.nextID++
	if r := C.mcg_post_read(q.qp, C.uint64_t(addr), C.uint32_t(key), C.uint64_t(remote), C.uint32_t(rkey), C.uint32_t(n), C.uint64_t(id)); r != 0 {
		return fmt.Errorf("%w: ibv_post_send: %v", ErrCompletion, syscall.Errno(r))
	}
	return q.wait(1, timeout)
}

// ReadOp is one RDMA READ: Len bytes of the peer's RemoteAddr (RKey) into
// local Addr.
type ReadOp struct {
	Addr, RemoteAddr, Len uint64
	RKey                  uint32
}

// Reads posts the reads as chains of at most the queue depth, each chain
// waited for with one completion (its last): one round trip per chain.
func (q *QP) Reads(rs []ReadOp, timeout time.Duration) error {
	n := len(rs)
	la, lk := make([]uint64, n), make([]uint32, n)
	ra, rk, ln := make([]uint64, n), make([]uint32, n), make([]uint32, n)
	for i, r := range rs {
		key, err := q.e.local(r.Addr, r.Len)
		if err != nil {
			return err
		}
		la[i], lk[i], ra[i], rk[i], ln[i] = r.Addr, key, r.RemoteAddr, r.RKey, uint32(r.Len)
	}
	for start := 0; start < n; start += q.depth {
		k := min(q.depth, n-start)
		base := q.nextID
		q.nextID += uint64(k)
		if r := C.mcg_post_reads(q.qp, C.int(k), (*C.uint64_t)(&la[start]), (*C.uint32_t)(&lk[start]), (*C.uint64_t)(&ra[start]),
			(*C.uint32_t)(&rk[start]), (*C.uint32_t)(&ln[start]), C.uint64_t(base)); r != 0 {
			return fmt.Errorf("%w: ibv_post_send: %v", ErrCompletion, syscall.Errno(r))
		}
		if err := q.wait(1, timeout); err != nil {
			return err
		}
	}
	return nil
}

// wait polls the queue pair's completion queue until n completions
// arrived (an error completion ends it). A queue pair is used by one
// goroutine at a time (its session's lock).
func (q *QP) wait(n int, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	var ids [64]C.uint64_t
	var sts [64]C.int
	for got := 0; got < n; {
		k := int(C.mcg_poll(q.qp, 64, &ids[0], &sts[0]))
		for i := 0; i < k; i++ {
			if sts[i] != C.IBV_WC_SUCCESS {
				return fmt.Errorf("%w: work request %d: %s", ErrCompletion, uint64(ids[i]), C.GoString(C.mcg_wc_status_str(sts[i])))
			}
		}
		got += k
		if got >= n {
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%w: %d of %d completions within %v", ErrCompletion, got, n, timeout)
		}
		if k == 0 {
			time.Sleep(20 * time.Microsecond)
		}
	}
	return nil
}
