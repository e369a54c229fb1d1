package core

import (
	"context"
	"fmt"
	"sync"
	"syscall"
	"time"
	"unsafe"

	"github.com/mcguard/mcguard/core/cuda"
	"github.com/mcguard/mcguard/core/rdma"
	"github.com/mcguard/mcguard/core/wire"
	"github.com/mcguard/mcguard/verify"
)

// rdmaSide is a guard's RDMA state, when its transport is RDMA: the
// endpoint, a memory region per registered host region, and on the target
// side one queue pair per sender.
type rdmaSide struct {
	ep    *rdma.Endpoint
	mu    sync.Mutex
	mrs   map[uint64]*rdma.MR // by region start
	peers map[string]*rdma.QP // by sender id
}

func openRDMA(path, device string, gidIndex int) (*rdmaSide, error) {
	v, err := rdma.Load(path)
	if err != nil {
		return nil, err
	}
	v.ForkInit()
	ep, err := v.Open(device, gidIndex)
	if err != nil {
		return nil, err
	}
	return &rdmaSide{ep: ep, mrs: map[uint64]*rdma.MR{}, peers: map[string]*rdma.QP{}}, nil
}

// register makes [addr, addr+n) a memory region. GPU memory goes as a
// dmabuf where the verbs library, the CUDA driver and the device all do
// it, else as a plain registration of the device pointer, which the
// kernel accepts where nvidia-peermem is loaded; neither is an
// MC_ERR_DEVICE that says what each lacked.
func (r *rdmaSide) register(addr, n uint64, mem cuda.Memory, gpu *cuda.Driver) error {
	var mr *rdma.MR
	var err error
	if mem.Device {
		mr, err = r.registerDevice(addr, n, mem, gpu)
		if err != nil {
			return err
		}
	} else if mr, err = r.ep.Register(addr, n); err != nil {
		return fmt.Errorf("%w: %v", ErrInvalidArg, err)
	}
	r.mu.Lock()
	r.mrs[addr] = mr
	r.mu.Unlock()
	return nil
}

func (r *rdmaSide) registerDevice(addr, n uint64, mem cuda.Memory, gpu *cuda.Driver) (*rdma.MR, error) {
	fd, offset, err := gpu.Dmabuf(addr, n, mem)
	if err == nil {
		mr, rerr := r.ep.RegisterDmabuf(fd, offset, n, addr)
		syscall.Close(fd) // the registration holds the dmabuf now
		if rerr == nil {
			return mr, nil
		}
		err = rerr
	}
	mr, perr := r.ep.Register(addr, n)
	if perr == nil {
		return mr, nil
	}
	return nil, fmt.Errorf("%w: GPU memory [%#x, +%d) cannot be registered for RDMA: as a dmabuf: %v; as a plain registration (needs nvidia-peermem): %v",
		ErrDevice, addr, n, err, perr)
}

func (r *rdmaSide) unregister(addr uint64) {
	r.mu.Lock()
	mr := r.mrs[addr]
	delete(r.mrs, addr)
	r.mu.Unlock()
	if mr != nil {
		r.ep.Deregister(mr)
	}
}

// rkeys returns the rkey of each region (0: not reachable over RDMA).
func (r *rdmaSide) rkeys(regions []Region) []uint32 {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]uint32, len(regions))
	for i, rg := range regions {
		if mr := r.mrs[rg.Addr]; mr != nil {
			out[i] = mr.RKey
		}
	}
	return out
}

// accept connects a queue pair of ours to a sender's, replacing the one
// an earlier handshake of the same sender made.
func (r *rdmaSide) accept(sender string, remote rdma.QPInfo) (rdma.QPInfo, error) {
	qp, err := r.ep.NewQP(qpDepth)
	if err != nil {
		return rdma.QPInfo{}, err
	}
	if err := qp.Connect(remote); err != nil {
		qp.Destroy()
		return rdma.QPInfo{}, err
	}
	r.mu.Lock()
	if old := r.peers[sender]; old != nil {
		old.Destroy()
	}
	r.peers[sender] = qp
	r.mu.Unlock()
	return qp.Info(), nil
}

func (r *rdmaSide) close() {
	r.mu.Lock()
	for id, qp := range r.peers {
		qp.Destroy()
		delete(r.peers, id)
	}
	for addr, mr := range r.mrs {
		r.ep.Deregister(mr)
		delete(r.mrs, addr)
	}
	r.mu.Unlock()
	r.ep.Close()
}

// bounceSize is the registered buffer read-backs land in.
const bounceSize = wire.WriteSlice

// rdmaConn is a session's data path over one RC queue pair: WRITEs for
// the data, and READs on the same queue pair for the read-backs (a READ
// returns only after the QP's earlier writes are visible at the target).
// The fence is a FLUSH of what was written where both ends do the FLUSH
// verb, else a READ.
type rdmaConn struct {
	side    *rdmaSide
	qp      *rdma.QP
	regions []Region
	rkeys   []uint32
	bounce  []byte
	mr      *rdma.MR
	timeout time.Duration
	flush   bool              // FLUSH fences: our QP can post them, the target's regions take them
	written map[uint32]extent // by rkey: what the writes since the last fence touched
}

// extent is the span [lo, hi) of a region's writes since the last fence.
type extent struct{ lo, hi uint64 }

// qpDepth is the send depth of a session's queue pair.
const qpDepth = 256

// connectRDMA finishes a session's queue pair with the target's answer.
func connectRDMA(side *rdmaSide, qp *rdma.QP, rep helloReply, timeout time.Duration) (*rdmaConn, error) {
	if rep.RDMA == nil || len(rep.RKeys) != len(rep.Regions) {
		qp.Destroy()
		return nil, fmt.Errorf("%w: the session answered without RDMA parameters (its transport is not RDMA)", ErrSession)
	}
	if err := qp.Connect(*rep.RDMA); err != nil {
		qp.Destroy()
		return nil, fmt.Errorf("%w: %v", ErrPeer, err)
	}
	b, err := syscall.Mmap(-1, 0, bounceSize, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
	if err != nil {
		qp.Destroy()
		return nil, fmt.Errorf("%w: bounce buffer: %v", ErrPeer, err)
	}
	mr, err := side.ep.Register(uint64(uintptr(unsafe.Pointer(&b[0]))), bounceSize)
	if err != nil {
		syscall.Munmap(b)
		qp.Destroy()
		return nil, fmt.Errorf("%w: %v", ErrPeer, err)
	}
	return &rdmaConn{side: side, qp: qp, regions: rep.Regions, rkeys: rep.RKeys, bounce: b, mr: mr, timeout: timeout,
		flush: qp.CanFlush() && rep.RDMAFlush, written: map[uint32]extent{}}, nil
}

func (c *rdmaConn) close() {
	c.qp.Destroy()
	c.side.ep.Deregister(c.mr)
	syscall.Munmap(c.bounce)
}

func (c *rdmaConn) rkey(addr, n uint64) (uint32, error) {
	for i, r := range c.regions {
		if r.contains(addr, n) && c.rkeys[i] != 0 {
			return c.rkeys[i], nil
		}
	}
	return 0, fmt.Errorf("%w: [%#x, +%d) has no rkey at the target", ErrNotRegistered, addr, n)
}

func rdmaErr(err error) error { return fmt.Errorf("%w: %v", ErrPeer, err) }

func (c *rdmaConn) write(_ context.Context, descs []verify.Desc, base int, local *Regions) error {
	var ws []rdma.Op
	for i, d := range descs {
		for off := uint64(0); off < d.Len; off += wire.WriteSlice {
			n := min(wire.WriteSlice, d.Len-off)
			key, err := c.rkey(d.Dst+off, n)
			if err != nil {
				return fmt.Errorf("descriptor %d: %w", base+i, err)
			}
			ws = append(ws, rdma.Op{Addr: d.Src + off, RemoteAddr: d.Dst + off, Len: n, RKey: key})
			c.touch(key, d.Dst+off, n)
		}
	}
	if err := c.qp.Writes(ws, c.timeout); err != nil {
		return rdmaErr(err)
	}
	return nil
}

func (c *rdmaConn) touch(rkey uint32, addr, n uint64) {
	e, ok := c.written[rkey]
	if !ok {
		e = extent{lo: addr, hi: addr + n}
	}
	c.written[rkey] = extent{lo: min(e.lo, addr), hi: max(e.hi, addr+n)}
}

// fence returns once the writes since the last fence are visible at the
// target: a FLUSH of each region's written span where both ends do the
// FLUSH verb, else a one-byte READ on the queue pair that carried them.
func (c *rdmaConn) fence(ctx context.Context) error {
	if len(c.written) == 0 {
		return nil
	}
	if c.flush {
		var fs []rdma.Op
		for key, e := range c.written {
			fs = append(fs, rdma.Op{RemoteAddr: e.lo, Len: e.hi - e.lo, RKey: key})
		}
		if err := c.qp.Flushes(fs, c.timeout); err != nil {
			return rdmaErr(err)
		}
		clear(c.written)
		return nil
	}
	for key, e := range c.written { // any byte the writes touched
		if err := c.readOps([]rdma.Op{{Addr: c.mr.Addr, RemoteAddr: e.lo, Len: 1, RKey: key}}); err != nil {
			return err
		}
		break
	}
	clear(c.written)
	return nil
}

func (c *rdmaConn) readOps(ops []rdma.Op) error {
	if err := c.qp.Reads(ops, c.timeout); err != nil {
		return rdmaErr(err)
	}
	return nil
}

// read reads the ranges through the bounce buffer, as many at a time as it
// holds (one round trip each), on the queue pair that carried the writes,
// so every read is fenced by construction: it returns the target's bytes
// as they are after every earlier write, which is what is checked.
func (c *rdmaConn) read(_ context.Context, ranges []verify.Range, out []byte, _ bool) error {
	clear(c.written)
	var batch []rdma.Op
	var used uint64
	off := 0
	flush := func() error {
		if len(batch) == 0 {
			return nil
		}
		if err := c.readOps(batch); err != nil {
			return err
		}
		off += copy(out[off:], c.bounce[:used])
		batch, used = batch[:0], 0
		return nil
	}
	for _, r := range ranges {
		for done := uint64(0); done < r.Len; {
			if used == bounceSize {
				if err := flush(); err != nil {
					return err
				}
			}
			n := min(bounceSize-used, r.Len-done)
			key, err := c.rkey(r.Addr+done, n)
			if err != nil {
				return err
			}
			batch = append(batch, rdma.Op{Addr: c.mr.Addr + used, RemoteAddr: r.Addr + done, Len: n, RKey: key})
			used += n
			done += n
		}
	}
	return flush()
}
