package verbs

/*
#include <stdlib.h>
#include "qp_shim.h"
*/
import "C"

import (
	"context"
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

// Device and Port name the port this endpoint opened.
func (e *Endpoint) Device() string { return C.GoString(&e.ep.ctx.device.name[0]) }

// Port is the port number on Device.
func (e *Endpoint) Port() int { return int(e.ep.port) }

// Flush reports whether the device does the IBTA FLUSH verb with global
// visibility; its memory regions and queue pairs then allow it.
func (e *Endpoint) Flush() bool { return e.ep.flush != 0 }

// GID is this endpoint's port GID.
func (e *Endpoint) GID() [16]byte {
	var g [16]byte
	copy(g[:], C.GoBytes(unsafe.Pointer(&e.ep.gid), 16))
	return g
}

// Register registers [addr, addr+n) for local and remote access. For GPU
// memory this works only where the kernel can pin it (nvidia-peermem).
func (e *Endpoint) Register(addr, n uint64) (*MR, error) {
	mr, errno := C.mcg_ep_reg(e.ep, unsafe.Pointer(uintptr(addr)), C.size_t(n))
	if mr == nil {
		return nil, fmt.Errorf("ibv_reg_mr(%#x, %d): %v", addr, n, errno)
	}
	return e.keep(addr, n, mr), nil
}

// RegisterDmabuf registers GPU memory exported as a dmabuf: n bytes at
// offset of fd, which peers address from iova (the device pointer).
func (e *Endpoint) RegisterDmabuf(fd int, offset, n, iova uint64) (*MR, error) {
	mr, errno := C.mcg_ep_reg_dmabuf(e.ep, C.uint64_t(offset), C.size_t(n), C.uint64_t(iova), C.int(fd))
	if mr == nil {
		if errno == syscall.ENOSYS {
			return nil, fmt.Errorf("this libibverbs lacks ibv_reg_dmabuf_mr (rdma-core 34 or newer has it)")
		}
		return nil, fmt.Errorf("ibv_reg_dmabuf_mr(fd %d, %#x, %d): %v", fd, iova, n, errno)
	}
	return e.keep(iova, n, mr), nil
}

func (e *Endpoint) keep(addr, n uint64, mr *C.struct_ibv_mr) *MR {
	m := &MR{Addr: addr, Len: n, LKey: uint32(C.mcg_mr_lkey(mr)), RKey: uint32(C.mcg_mr_rkey(mr)), mr: mr}
	e.mu.Lock()
	e.mrs[addr] = m
	e.mu.Unlock()
	return m
}

// Deregister releases mr.
func (e *Endpoint) Deregister(m *MR) {
	e.mu.Lock()
	if e.mrs[m.Addr] == m { // not a newer registration of the same range
		delete(e.mrs, m.Addr)
	}
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

// Reach is how many bytes there are from addr to the end of the
// registered region holding it (0: none does), for WRITEs of joined
// descriptors, which must lie in one region for their lkey.
func (e *Endpoint) Reach(addr uint64) uint64 {
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, m := range e.mrs {
		if addr >= m.Addr && addr < m.Addr+m.Len {
			return m.Addr + m.Len - addr
		}
	}
	return 0
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
	flush  bool // an extended QP that can post FLUSH
	// Posted writes not waited for (PostWrites): the work requests still
	// in the send queue and the completions owed; the next chain waits for
	// them with its own.
	owedWRs, owed int
}

// NewQP creates a queue pair of the given send depth.
func (e *Endpoint) NewQP(depth int) (*QP, error) {
	var flush C.int
	qp := C.mcg_qp_create(e.ep, C.int(depth), &flush)
	if qp == nil {
		return nil, fmt.Errorf("ibv_create_qp failed")
	}
	return &QP{e: e, qp: qp, depth: depth, psn: uint32(time.Now().UnixNano()) & 0xffffff, flush: flush != 0}, nil
}

// CanFlush reports whether this queue pair can post FLUSH.
func (q *QP) CanFlush() bool { return q.flush }

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
	q.owedWRs, q.owed = 0, 0
}

// Destroy releases the queue pair.
func (q *QP) Destroy() { C.mcg_qp_destroy(q.e.ep, q.qp) }

// Op is one RDMA WRITE or READ: Len bytes between local Addr and the
// peer's RemoteAddr under RKey.
type Op struct {
	Addr, RemoteAddr, Len uint64
	RKey                  uint32
}

// Writes posts the writes as chains of at most the queue depth, signalling
// every half depth and the last, and waits for their completions. A
// completion means the peer NIC accepted them — not that the bytes are
// visible there: that takes a fence (a READ on this QP).
func (q *QP) Writes(ctx context.Context, ops []Op, timeout time.Duration) error {
	return q.post(ctx, false, ops, max(1, q.depth/2), timeout)
}

// PostWrites posts the writes as one chain and returns without waiting for
// their completions: the next operation on the queue pair waits for them
// with its own, so writes and the READ or FLUSH that fences them make one
// round trip. More writes than the queue holds are written as Writes does.
func (q *QP) PostWrites(ctx context.Context, ops []Op, timeout time.Duration) error {
	if len(ops) > q.depth-q.owedWRs {
		return q.Writes(ctx, ops, timeout)
	}
	return q.postChains(ctx, false, ops, max(1, q.depth/2), timeout, true)
}

// Reads posts the reads as chains of at most the queue depth, each chain
// waited for with one completion (its last): one round trip per chain. A
// READ is answered after every earlier write on this QP is visible at the
// peer: the fence.
func (q *QP) Reads(ctx context.Context, ops []Op, timeout time.Duration) error {
	return q.post(ctx, true, ops, q.depth, timeout)
}

// Flushes posts a FLUSH (global visibility, range) per op — RemoteAddr,
// Len and RKey; Addr is unused — as chains of at most the queue depth,
// each waited for with one completion: when it arrives, the QP's earlier
// writes to those ranges are visible at the target. The target's regions
// must have been registered for FLUSH (its endpoint's Flush).
func (q *QP) Flushes(ctx context.Context, ops []Op, timeout time.Duration) error {
	if !q.flush {
		return fmt.Errorf("this queue pair cannot post FLUSH (the device or its provider lacks it)")
	}
	n := len(ops)
	ra, rk, ln := make([]uint64, n), make([]uint32, n), make([]uint64, n)
	for i, o := range ops {
		ra[i], rk[i], ln[i] = o.RemoteAddr, o.RKey, o.Len
	}
	return q.inChains(ctx, n, n, "posting FLUSH", timeout, func(start, k int, base uint64) C.int {
		return C.mcg_post_flush(q.e.ep, q.qp, C.int(k), (*C.uint64_t)(&ra[start]), (*C.uint32_t)(&rk[start]), (*C.uint64_t)(&ln[start]), C.uint64_t(base))
	})
}

// inChains posts n work requests as chains of at most the queue depth —
// post(start, k, base) posts k of them from start, with wr_ids from base,
// every signalEvery-th and the last of a chain signaled — and waits for
// each chain's completions before the next.
//
// With leave (PostWrites: one chain), the chain's completions are left
// owed instead. Completions owed by an earlier PostWrites are waited for
// with the first chain, or before it where the queue has no room for both.
func (q *QP) inChains(ctx context.Context, n, signalEvery int, what string, timeout time.Duration, post func(start, k int, base uint64) C.int, leave ...bool) error {
	for start := 0; start < n; start += q.depth {
		k := min(q.depth, n-start)
		if q.owedWRs+k > q.depth { // no room beside the posted writes: take their completions first
			if err := q.collect(ctx, 0, timeout); err != nil {
				return err
			}
		}
		base := q.nextID
		q.nextID += uint64(k)
		if r := post(start, k, base); r != 0 {
			return fmt.Errorf("%w: %s: %v", ErrCompletion, what, syscall.Errno(r))
		}
		completions := (k + signalEvery - 1) / signalEvery
		if len(leave) > 0 && leave[0] {
			q.owedWRs, q.owed = q.owedWRs+k, q.owed+completions
			continue
		}
		if err := q.collect(ctx, completions, timeout); err != nil {
			return err
		}
	}
	return nil
}

// collect waits for n completions besides those owed, and then owes none.
func (q *QP) collect(ctx context.Context, n int, timeout time.Duration) error {
	n += q.owed
	q.owedWRs, q.owed = 0, 0
	return q.wait(ctx, n, timeout)
}

// Read reads n bytes of the peer's memory into local addr.
func (q *QP) Read(ctx context.Context, addr, remote uint64, rkey uint32, n uint64, timeout time.Duration) error {
	return q.Reads(ctx, []Op{{Addr: addr, RemoteAddr: remote, Len: n, RKey: rkey}}, timeout)
}

// post checks every local range against the registered regions (refused
// before posting), then posts chains of at most the queue depth with every
// signalEvery-th and the last signaled, and waits for each chain.
func (q *QP) post(ctx context.Context, read bool, ops []Op, signalEvery int, timeout time.Duration) error {
	return q.postChains(ctx, read, ops, signalEvery, timeout, false)
}

// postChains is post; with leave, its completions are left owed.
func (q *QP) postChains(ctx context.Context, read bool, ops []Op, signalEvery int, timeout time.Duration, leave bool) error {
	n := len(ops)
	la, lk := make([]uint64, n), make([]uint32, n)
	ra, rk, ln := make([]uint64, n), make([]uint32, n), make([]uint32, n)
	for i, o := range ops {
		key, err := q.e.local(o.Addr, o.Len)
		if err != nil {
			return err
		}
		if o.Len > 1<<31 {
			return fmt.Errorf("operation %d of %d bytes: slice it", i, o.Len)
		}
		la[i], lk[i], ra[i], rk[i], ln[i] = o.Addr, key, o.RemoteAddr, o.RKey, uint32(o.Len)
	}
	isRead := C.int(0)
	if read {
		isRead = 1
	}
	return q.inChains(ctx, n, signalEvery, "ibv_post_send", timeout, func(start, k int, base uint64) C.int {
		return C.mcg_post_chain(q.qp, isRead, C.int(k), (*C.uint64_t)(&la[start]), (*C.uint32_t)(&lk[start]), (*C.uint64_t)(&ra[start]),
			(*C.uint32_t)(&rk[start]), (*C.uint32_t)(&ln[start]), C.uint64_t(base), C.int(signalEvery))
	}, leave)
}

// wait polls the queue pair's completion queue until n completions
// arrived (an error completion ends it), the timeout passes or ctx ends;
// after the last two the work may still complete, so the caller must
// destroy or reset the queue pair before reusing what it pointed at. A
// queue pair is used by one goroutine at a time (its session's lock).
func (q *QP) wait(ctx context.Context, n int, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	var ids [64]C.uint64_t
	var sts [64]C.int
	// A failing work request's own error says more than the flush errors
	// of those behind it, which a NIC may report first: keep the first
	// error that is not a flush.
	var flushed error
	for got := 0; got < n; {
		k := int(C.mcg_poll(q.qp, 64, &ids[0], &sts[0]))
		for i := 0; i < k; i++ {
			if sts[i] == C.IBV_WC_SUCCESS {
				continue
			}
			err := fmt.Errorf("%w: work request %d: %s", ErrCompletion, uint64(ids[i]), C.GoString(C.mcg_wc_status_str(sts[i])))
			if sts[i] != C.IBV_WC_WR_FLUSH_ERR {
				return err
			}
			if flushed == nil {
				flushed = err
			}
		}
		got += k
		if got >= n {
			break
		}
		if time.Now().After(deadline) {
			if flushed != nil {
				return flushed
			}
			return fmt.Errorf("%w: %d of %d completions within %v", ErrCompletion, got, n, timeout)
		}
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("%w: %d of %d completions when the wait was cancelled: %w", ErrCompletion, got, n, err)
		}
		if k == 0 {
			time.Sleep(20 * time.Microsecond)
		}
	}
	if flushed != nil {
		return flushed
	}
	return nil
}
