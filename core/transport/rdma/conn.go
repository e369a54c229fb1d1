package rdma

import (
	"context"
	"encoding/json"
	"fmt"
	"syscall"
	"time"
	"unsafe"

	"github.com/mcguard/mcguard/core/desc"
	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/core/memory"
	"github.com/mcguard/mcguard/core/transport"
	"github.com/mcguard/mcguard/core/transport/rdma/verbs"
)

// bounceSize is the registered buffer read-backs land in.
const bounceSize = transport.MaxSlice

// conn is a session's data path over RC queue pairs (rdma_qps of
// them): a batch's WRITEs are striped over them, and each queue pair that
// carried writes is fenced on its own, because queue pairs have no order
// between them. The fence is a FLUSH of what was written where both ends
// do the FLUSH verb, else a READ. Read-backs are READs on the first queue
// pair, after the others are fenced (a READ returns only after the earlier
// writes of its own queue pair are visible at the target).
type conn struct {
	caps    transport.Caps
	t       *Transport
	stripes []*stripe
	regions []memory.Region
	rkeys   []uint32
	bounce  []byte
	mr      *verbs.MR
	timeout time.Duration
	flush   bool // FLUSH fences: our QPs can post them, the target's regions take them
}

// stripe is one queue pair of a session and what its writes since its
// last fence touched, by rkey.
type stripe struct {
	qp      *verbs.QP
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

// connect finishes a session's queue pairs with the target's answer; it
// owns qps from here on.
func connect(t *Transport, qps []*verbs.QP, a answer, regions []memory.Region) (*conn, error) {
	fail := func(err error) (*conn, error) {
		destroyQPs(qps)
		return nil, err
	}
	if len(a.QPs) != len(qps) || len(a.RKeys) != len(regions) {
		return fail(fmt.Errorf("%w: the session answered %d of %d queue pairs (is its transport RDMA?)", errs.Session, len(a.QPs), len(qps)))
	}
	c := &conn{t: t, regions: regions, rkeys: a.RKeys, timeout: t.cfg.Timeout, flush: a.Flush}
	c.caps.Post = c
	for i, qp := range qps {
		if err := qp.Connect(a.QPs[i]); err != nil {
			return fail(fmt.Errorf("%w: %v", errs.Peer, err))
		}
		c.flush = c.flush && qp.CanFlush()
		c.stripes = append(c.stripes, &stripe{qp: qp, written: map[uint32]extent{}})
	}
	b, err := syscall.Mmap(-1, 0, bounceSize, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
	if err != nil {
		return fail(fmt.Errorf("%w: bounce buffer: %v", errs.Peer, err))
	}
	mr, err := t.ep.Register(uint64(uintptr(unsafe.Pointer(&b[0]))), bounceSize)
	if err != nil {
		syscall.Munmap(b)
		return fail(fmt.Errorf("%w: %v", errs.Peer, err))
	}
	c.bounce, c.mr = b, mr
	return c, nil
}

// Close destroys the queue pairs (work still queued on them is dropped),
// then releases the bounce buffer they may have pointed into.
func (c *conn) Close() {
	for _, s := range c.stripes {
		s.qp.Destroy()
	}
	c.t.ep.Deregister(c.mr)
	syscall.Munmap(c.bounce)
}

// FenceIsFinal: a READ or FLUSH returns after every earlier write of its
// queue pair is visible, and every queue pair that wrote is fenced.
func (*conn) FenceIsFinal() bool { return true }

// Caps: posted writes, read with the fence (transport.Caps).
func (c *conn) Caps() *transport.Caps { return &c.caps }

// Refresh takes the rkeys of a newer region table.
func (c *conn) Refresh(raw []byte, regions []memory.Region) error {
	var a answer
	if err := json.Unmarshal(raw, &a); err != nil || len(a.RKeys) != len(regions) {
		return fmt.Errorf("%w: malformed rdma answer to a refresh", errs.Session)
	}
	c.regions, c.rkeys = regions, a.RKeys
	return nil
}

// Unfenced reports, per queue pair, how many regions it wrote to since its
// last fence.
func (c *conn) Unfenced() []int {
	out := make([]int, len(c.stripes))
	for i, s := range c.stripes {
		out[i] = len(s.written)
	}
	return out
}

func (c *conn) rkey(addr, n uint64) (uint32, error) {
	for i, r := range c.regions {
		if r.Contains(addr, n) && c.rkeys[i] != 0 {
			return c.rkeys[i], nil
		}
	}
	return 0, fmt.Errorf("%w: [%#x, +%d) has no rkey at the target", errs.NotRegistered, addr, n)
}

// reach is how far a WRITE of joined descriptors may span from src and
// dst: inside the memory region holding each, here and at the target.
func (c *conn) reach(src, dst uint64) uint64 {
	far := uint64(0)
	for i, r := range c.regions {
		if r.Contains(dst, 1) && c.rkeys[i] != 0 {
			far = r.End() - dst
			break
		}
	}
	return min(far, c.t.ep.Reach(src))
}

func rdmaErr(err error) error { return fmt.Errorf("%w: %v", errs.Peer, err) }

// eachStripe runs fn on the stripes that want at once (transport.Each).
func (c *conn) eachStripe(want func(i int, s *stripe) bool, fn func(i int, s *stripe) error) error {
	return transport.Each(len(c.stripes), func(i int) bool { return want(i, c.stripes[i]) }, func(i int) error { return fn(i, c.stripes[i]) })
}

// Write slices the descriptors into WRITEs and stripes them in order over
// the queue pairs, each stripe a contiguous run of about the same number
// of bytes, posted at once.
func (c *conn) Write(ctx context.Context, descs []desc.Desc, base int) error {
	return c.write(ctx, descs, base, false)
}

// Post is Write without waiting for the completions (transport.Poster): the
// fence or the read-backs that follow on each queue pair wait for them
// with their own, one round trip for the chunk.
func (c *conn) Post(ctx context.Context, descs []desc.Desc, base int) error {
	return c.write(ctx, descs, base, true)
}

func (c *conn) write(ctx context.Context, descs []desc.Desc, base int, post bool) error {
	var ws []verbs.Op
	var total uint64
	for _, d := range descs {
		total += d.Len
	}
	share := (total + uint64(len(c.stripes)) - 1) / uint64(len(c.stripes))
	// Descriptors that continue one another go as one WRITE, inside one
	// memory region at each end (transport.Cursor), and of at most a
	// queue pair's share of the batch, so that every queue pair has one.
	frames := transport.Cursor{Descs: descs, Reach: c.reach, Max: share}
	for sl, more := frames.Next(); more; sl, more = frames.Next() {
		key, err := c.rkey(sl.Dst, sl.Len)
		if err != nil {
			return fmt.Errorf("descriptor %d: %w", base+sl.Desc, err)
		}
		ws = append(ws, verbs.Op{Addr: sl.Src, RemoteAddr: sl.Dst, Len: sl.Len, RKey: key})
		sl.CountJoined(c.t.cfg.Joined)
	}
	runs := make([][]verbs.Op, len(c.stripes))
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
		write := s.qp.Writes
		if post {
			write = s.qp.PostWrites
		}
		if err := write(ctx, runs[i], c.timeout); err != nil {
			return rdmaErr(err)
		}
		return nil
	})
}

// Fence returns once the writes since the last fence are visible at the
// target: on each queue pair that carried some, at once.
func (c *conn) Fence(ctx context.Context) error {
	return c.fenceStripes(ctx, func(int, *stripe) bool { return true })
}

func (c *conn) fenceStripes(ctx context.Context, want func(i int, s *stripe) bool) error {
	return c.eachStripe(func(i int, s *stripe) bool { return len(s.written) > 0 && want(i, s) }, func(_ int, s *stripe) error {
		return c.fenceStripe(ctx, s)
	})
}

// maxFlushLen bounds the range of one FLUSH.
const maxFlushLen = 1 << 30

// fenceStripe is a FLUSH of each region's written span where both ends do
// the FLUSH verb, else a one-byte READ of something the writes touched.
func (c *conn) fenceStripe(ctx context.Context, s *stripe) error {
	var ops []verbs.Op
	for key, e := range s.written {
		for lo := e.lo; lo < e.hi; lo += maxFlushLen { // a FLUSH's length is 32 bits on the wire
			ops = append(ops, verbs.Op{RemoteAddr: lo, Len: min(maxFlushLen, e.hi-lo), RKey: key})
		}
	}
	var err error
	if c.flush {
		err = s.qp.Flushes(ctx, ops, c.timeout)
	} else {
		// One byte into the bounce buffer: the READ is the fence, not the
		// data (a concurrent fence of another stripe may land on it too).
		err = s.qp.Reads(ctx, []verbs.Op{{Addr: c.mr.Addr, RemoteAddr: ops[0].RemoteAddr, Len: 1, RKey: ops[0].RKey}}, c.timeout)
	}
	if err != nil {
		return rdmaErr(err)
	}
	clear(s.written)
	return nil
}

// Read reads the ranges through the bounce buffer, as many at a time as it
// holds (one round trip each), on the first queue pair, after fencing the
// others that carried writes: so every read is fenced, and returns the
// target's bytes as they are after every earlier write, which is what is
// checked.
func (c *conn) Read(ctx context.Context, ranges []desc.Range, out []byte, _ bool) error {
	if err := c.fenceStripes(ctx, func(i int, _ *stripe) bool { return i > 0 }); err != nil {
		return err
	}
	qp := c.stripes[0].qp
	clear(c.stripes[0].written)
	var batch []verbs.Op
	var used uint64
	off := 0
	flush := func() error {
		if len(batch) == 0 {
			return nil
		}
		if err := qp.Reads(ctx, batch, c.timeout); err != nil {
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
			batch = append(batch, verbs.Op{Addr: c.mr.Addr + used, RemoteAddr: r.Addr + done, Len: n, RKey: key})
			used += n
			done += n
		}
	}
	return flush()
}
