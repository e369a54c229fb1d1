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
// endpoint, a memory region per registered region (host or GPU), and on
// the target side the queue pairs of each sender.
type rdmaSide struct {
	ep    *rdma.Endpoint
	mu    sync.Mutex
	mrs   map[uint64]*rdma.MR   // by region start
	peers map[string][]*rdma.QP // by sender id
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
	return &rdmaSide{ep: ep, mrs: map[uint64]*rdma.MR{}, peers: map[string][]*rdma.QP{}}, nil
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

// MaxRDMAQPs bounds the queue pairs of one session (rdma_qps).
const MaxRDMAQPs = 16

// maxTargetQPs bounds the queue pairs a target keeps for all its senders
// together: a flood of handshakes is refused, not served until the NIC
// runs out. A variable, for tests.
var maxTargetQPs = 1024

// accept connects a queue pair of ours to each of a sender's, replacing
// those an earlier handshake of the same sender made.
func (r *rdmaSide) accept(sender string, remotes []rdma.QPInfo) ([]rdma.QPInfo, error) {
	qps := make([]*rdma.QP, 0, len(remotes))
	fail := func(err error) ([]rdma.QPInfo, error) {
		destroyQPs(qps)
		return nil, err
	}
	r.mu.Lock()
	held := 0
	for id, old := range r.peers {
		if id != sender { // a sender's own are replaced
			held += len(old)
		}
	}
	r.mu.Unlock()
	if held+len(remotes) > maxTargetQPs {
		return nil, fmt.Errorf("this guard holds %d queue pairs for other senders; %d more would pass its limit of %d", held, len(remotes), maxTargetQPs)
	}
	infos := make([]rdma.QPInfo, len(remotes))
	for i, remote := range remotes {
		qp, err := r.ep.NewQP(qpDepth)
		if err != nil {
			return fail(err)
		}
		qps = append(qps, qp)
		if err := qp.Connect(remote); err != nil {
			return fail(err)
		}
		infos[i] = qp.Info()
	}
	r.mu.Lock()
	destroyQPs(r.peers[sender])
	r.peers[sender] = qps
	r.mu.Unlock()
	return infos, nil
}

func destroyQPs(qps []*rdma.QP) {
	for _, qp := range qps {
		qp.Destroy()
	}
}

func (r *rdmaSide) close() {
	r.mu.Lock()
	for id, qps := range r.peers {
		destroyQPs(qps)
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

// qpDepth is the send depth of each queue pair.
const qpDepth = 256

// rdmaConn is a session's data path over RC queue pairs (rdma_qps of
// them): a batch's WRITEs are striped over them, and each queue pair that
// carried writes is fenced on its own, because queue pairs have no order
// between them. The fence is a FLUSH of what was written where both ends
// do the FLUSH verb, else a READ. Read-backs are READs on the first queue
// pair, after the others are fenced (a READ returns only after the earlier
// writes of its own queue pair are visible at the target).
type rdmaConn struct {
	side    *rdmaSide
	stripes []*stripe
	regions []Region
	rkeys   []uint32
	bounce  []byte
	mr      *rdma.MR
	timeout time.Duration
	flush   bool // FLUSH fences: our QPs can post them, the target's regions take them
}

// stripe is one queue pair of a session and what its writes since its
// last fence touched, by rkey.
type stripe struct {
	qp      *rdma.QP
	written map[uint32]extent
}

// extent is the span [lo, hi) of a region's writes since the last fence.
type extent struct{ lo, hi uint64 }

func (s *stripe) touch(rkey uint32, addr, n uint64) {
	e, ok := s.written[rkey]
	if !ok {
		e = extent{lo: addr, hi: addr + n}
	}
	s.written[rkey] = extent{lo: min(e.lo, addr), hi: max(e.hi, addr+n)}
}

// newSessionQPs makes the queue pairs a session asks the target to connect to.
func newSessionQPs(side *rdmaSide, n int) ([]*rdma.QP, []rdma.QPInfo, error) {
	qps := make([]*rdma.QP, 0, n)
	infos := make([]rdma.QPInfo, n)
	for i := range infos {
		qp, err := side.ep.NewQP(qpDepth)
		if err != nil {
			destroyQPs(qps)
			return nil, nil, fmt.Errorf("%w: %v", ErrPeer, err)
		}
		qps = append(qps, qp)
		infos[i] = qp.Info()
	}
	return qps, infos, nil
}

// connectRDMA finishes a session's queue pairs with the target's answer;
// it owns qps from here on.
func connectRDMA(side *rdmaSide, qps []*rdma.QP, rep helloReply, timeout time.Duration) (*rdmaConn, error) {
	fail := func(err error) (*rdmaConn, error) {
		destroyQPs(qps)
		return nil, err
	}
	if len(rep.RDMA) != len(qps) || len(rep.RKeys) != len(rep.Regions) {
		return fail(fmt.Errorf("%w: the session answered %d of %d queue pairs (is its transport RDMA?)", ErrSession, len(rep.RDMA), len(qps)))
	}
	c := &rdmaConn{side: side, regions: rep.Regions, rkeys: rep.RKeys, timeout: timeout, flush: rep.RDMAFlush}
	for i, qp := range qps {
		if err := qp.Connect(rep.RDMA[i]); err != nil {
			return fail(fmt.Errorf("%w: %v", ErrPeer, err))
		}
		c.flush = c.flush && qp.CanFlush()
		c.stripes = append(c.stripes, &stripe{qp: qp, written: map[uint32]extent{}})
	}
	b, err := syscall.Mmap(-1, 0, bounceSize, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
	if err != nil {
		return fail(fmt.Errorf("%w: bounce buffer: %v", ErrPeer, err))
	}
	mr, err := side.ep.Register(uint64(uintptr(unsafe.Pointer(&b[0]))), bounceSize)
	if err != nil {
		syscall.Munmap(b)
		return fail(fmt.Errorf("%w: %v", ErrPeer, err))
	}
	c.bounce, c.mr = b, mr
	return c, nil
}

func (c *rdmaConn) close() {
	for _, s := range c.stripes {
		s.qp.Destroy()
	}
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

// eachStripe runs fn on the stripes that want at once, one goroutine each, and returns the first error. A lone
// stripe (rdma_qps 1, the default) runs on the caller's goroutine.
func (c *rdmaConn) eachStripe(want func(i int, s *stripe) bool, fn func(i int, s *stripe) error) error {
	var chosen []int
	for i, s := range c.stripes {
		if want(i, s) {
			chosen = append(chosen, i)
		}
	}
	if len(chosen) == 1 {
		return fn(chosen[0], c.stripes[chosen[0]])
	}
	errs := make([]error, len(c.stripes))
	var wg sync.WaitGroup
	for _, i := range chosen {
		s := c.stripes[i]
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = fn(i, s)
		}()
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}

// write slices the descriptors into WRITEs of at most wire.WriteSlice and
// stripes them in order over the queue pairs, each stripe a contiguous run
// of about the same number of bytes, posted at once.
func (c *rdmaConn) write(_ context.Context, descs []verify.Desc, base int, _ *Regions) error {
	var ws []rdma.Op
	var total uint64
	for i, d := range descs {
		for off := uint64(0); off < d.Len; off += wire.WriteSlice {
			n := min(wire.WriteSlice, d.Len-off)
			key, err := c.rkey(d.Dst+off, n)
			if err != nil {
				return fmt.Errorf("descriptor %d: %w", base+i, err)
			}
			ws = append(ws, rdma.Op{Addr: d.Src + off, RemoteAddr: d.Dst + off, Len: n, RKey: key})
			total += n
		}
	}
	runs := make([][]rdma.Op, len(c.stripes))
	share := (total + uint64(len(c.stripes)) - 1) / uint64(len(c.stripes))
	k, filled := 0, uint64(0)
	for _, w := range ws {
		if filled >= share && k < len(runs)-1 {
			k, filled = k+1, 0
		}
		runs[k] = append(runs[k], w)
		filled += w.Len
		c.stripes[k].touch(w.RKey, w.RemoteAddr, w.Len)
	}
	return c.eachStripe(func(i int, _ *stripe) bool { return len(runs[i]) > 0 }, func(i int, s *stripe) error {
		if err := s.qp.Writes(runs[i], c.timeout); err != nil {
			return rdmaErr(err)
		}
		return nil
	})
}

// fence returns once the writes since the last fence are visible at the
// target: on each queue pair that carried some, at once.
func (c *rdmaConn) fence(context.Context) error {
	return c.fenceStripes(func(int, *stripe) bool { return true })
}

func (c *rdmaConn) fenceStripes(want func(i int, s *stripe) bool) error {
	return c.eachStripe(func(i int, s *stripe) bool { return len(s.written) > 0 && want(i, s) }, c.fenceStripe)
}

// maxFlushLen bounds the range of one FLUSH.
const maxFlushLen = 1 << 30

// fenceStripe is a FLUSH of each region's written span where both ends do
// the FLUSH verb, else a one-byte READ of something the writes touched.
func (c *rdmaConn) fenceStripe(_ int, s *stripe) error {
	var ops []rdma.Op
	for key, e := range s.written {
		for lo := e.lo; lo < e.hi; lo += maxFlushLen { // a FLUSH's length is 32 bits on the wire
			ops = append(ops, rdma.Op{RemoteAddr: lo, Len: min(maxFlushLen, e.hi-lo), RKey: key})
		}
	}
	var err error
	if c.flush {
		err = s.qp.Flushes(ops, c.timeout)
	} else {
		// One byte into the bounce buffer: the READ is the fence, not the
		// data (a concurrent fence of another stripe may land on it too).
		err = s.qp.Reads([]rdma.Op{{Addr: c.mr.Addr, RemoteAddr: ops[0].RemoteAddr, Len: 1, RKey: ops[0].RKey}}, c.timeout)
	}
	if err != nil {
		return rdmaErr(err)
	}
	clear(s.written)
	return nil
}

// read reads the ranges through the bounce buffer, as many at a time as it
// holds (one round trip each), on the first queue pair, after fencing the
// others that carried writes: so every read is fenced, and returns the
// target's bytes as they are after every earlier write, which is what is
// checked.
func (c *rdmaConn) read(_ context.Context, ranges []verify.Range, out []byte, _ bool) error {
	if err := c.fenceStripes(func(i int, _ *stripe) bool { return i > 0 }); err != nil {
		return err
	}
	qp := c.stripes[0].qp
	clear(c.stripes[0].written)
	var batch []rdma.Op
	var used uint64
	off := 0
	flush := func() error {
		if len(batch) == 0 {
			return nil
		}
		if err := qp.Reads(batch, c.timeout); err != nil {
			return rdmaErr(err)
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
