package engine

import (
	"context"
	"fmt"
	"sync"
	"syscall"

	"github.com/mcguard/mcguard/core/desc"
	"github.com/mcguard/mcguard/core/fault"
	"github.com/mcguard/mcguard/core/memory"
	"github.com/mcguard/mcguard/core/transport"
)

// conn is one session over the engine: the engine's name for the peer,
// and the session's own scratch, registered with the engine, that
// read-backs land in.
type conn struct {
	caps    transport.Caps
	p       *Plane
	session string
	scratch *scratch
	// transfer is the id of the transfer the session's calls are made
	// for (SetTransfer), 0 between transfers: a call counts for it until
	// it returns (Plane.WaitTransfer).
	transfer uint64
	// began is the epoch of the receivers' quiesces the transfer began
	// under (a later one's ranges are closed to it).
	began uint64
	// spins is the session's back-off of waiting awake for its calls'
	// answers (handoff).
	spins transport.SpinBackoff
	// reach joins consecutive descriptors into one request (joins); nil:
	// one request per descriptor.
	reach func(src, dst uint64) uint64
}

// SetTransfer says which transfer the next calls are made for (0: none).
// The session's lock orders it with them.
func (c *conn) SetTransfer(id uint64) {
	switch {
	case id != 0 && c.transfer == 0:
		c.began = c.p.startTransfer(c.session)
	case id == 0 && c.transfer != 0:
		c.p.endTransfer(c.session, c.began)
	}
	c.transfer = id
}

// Conn returns session's connection over the engine: no handshake, the
// engine knows its peers.
func (p *Plane) Conn(session string) transport.Conn {
	c := &conn{p: p, session: session}
	c.caps.Tagged = c
	return c
}

// Write hands the batch to the engine in one call, consecutive
// descriptors joined where the session may (joins), under fault injection
// when it is on.
func (c *conn) Write(ctx context.Context, descs []desc.Desc, _ int) error {
	local, remote, n := make([]uint64, 0, len(descs)), make([]uint64, 0, len(descs)), make([]uint64, 0, len(descs))
	// Each descriptor whole (the engine cuts its requests itself), runs of
	// consecutive ones joined up to the engine's slice where c.reach says.
	requests := transport.Cursor{Descs: descs, Reach: c.reach, Max: c.p.join.max, Whole: true}
	for sl, more := requests.Next(); more; sl, more = requests.Next() {
		sl.CountJoined(c.p.join.count)
		d := desc.Desc{Src: sl.Src, Dst: sl.Dst, Len: sl.Len}
		if c.p.faults.Mode() == fault.Lie {
			if c.p.faults.Lies() {
				c.p.lies.keep(c.session, d.Dst, d.Src, d.Len)
				continue
			}
			c.p.lies.forget(c.session, d.Dst, d.Len)
		}
		k, held := d.Len, false
		if c.p.faults != nil {
			k, held = c.p.faults.Cut(d.Len)
		}
		if held {
			c.p.hold(c, d.Src, d.Dst, d.Len)
			continue
		}
		if k > 0 {
			local, remote, n = append(local, d.Src), append(remote, d.Dst), append(n, k)
		}
	}
	if len(n) == 0 {
		return nil
	}
	return c.p.call(ctx, c, remote, n, func() error { return c.p.ops.Write(c.session, local, remote, n) }, nil)
}

// Fence calls the engine's fence, where it has one.
func (c *conn) Fence(ctx context.Context) error {
	if c.p.ops.Fence == nil {
		return nil
	}
	return c.p.call(ctx, c, nil, nil, func() error { return c.p.ops.Fence(c.session) }, nil)
}

// FenceIsFinal is false: an engine's completion (Mooncake's spreads slices
// over queue pairs and NICs) does not order a later read behind the
// writes, so a mismatch is polled.
func (c *conn) FenceIsFinal() bool { return false }

// Caps: calls counted per transfer (transport.Caps).
func (c *conn) Caps() *transport.Caps { return &c.caps }

// Read reads ranges through the engine into the session's scratch, in one
// call, and copies them into out.
func (c *conn) Read(ctx context.Context, ranges []desc.Range, out []byte, fenced bool) error {
	if fenced {
		if err := c.Fence(ctx); err != nil {
			return err
		}
	}
	s, err := c.scratchFor(uint64(len(out)))
	if err != nil {
		return err
	}
	local, remote, n := make([]uint64, len(ranges)), make([]uint64, len(ranges)), make([]uint64, len(ranges))
	var off uint64
	for i, r := range ranges {
		local[i], remote[i], n[i] = s.addr+off, r.Addr, r.Len
		off += r.Len
	}
	s.hold()
	if err := c.p.call(ctx, c, nil, nil, func() error { return c.p.ops.Read(c.session, local, remote, n) }, s.release); err != nil {
		// The engine may still write into the scratch: let it go, and
		// give the next read fresh scratch.
		c.scratch = nil
		s.drop()
		return err
	}
	copy(out, s.mem[:len(out)])
	if c.p.faults.Mode() == fault.Lie {
		off = 0
		for _, r := range ranges {
			c.p.lies.tell(c.session, r.Addr, out[off:off+r.Len])
			off += r.Len
		}
	}
	return nil
}

// Refresh has nothing to refresh: the engine keeps its peers' tables.
func (c *conn) Refresh([]byte, []memory.Region) error { return nil }

// Close lets the scratch go once no engine call still reads into it.
func (c *conn) Close() {
	if c.scratch != nil {
		c.scratch.drop()
		c.scratch = nil
	}
}

// scratchFor returns the session's scratch, at least n bytes, registered
// with the engine: grown by replacing it.
func (c *conn) scratchFor(n uint64) (*scratch, error) {
	if c.scratch != nil && uint64(len(c.scratch.mem)) >= n {
		return c.scratch, nil
	}
	size := uint64(64 << 10)
	for size < n {
		size *= 2
	}
	s, err := newScratch(c.p, size)
	if err != nil {
		return nil, err
	}
	if c.scratch != nil {
		c.scratch.drop()
	}
	c.scratch = s
	return s, nil
}

// scratch is read-back memory outside Go's heap (the engine holds its
// address), registered with the engine, and unmapped only once it is
// dropped and no engine call reads into it any more.
type scratch struct {
	p    *Plane
	mem  []byte
	addr uint64

	mu      sync.Mutex
	users   int // engine calls reading into it
	dropped bool
}

func newScratch(p *Plane, size uint64) (*scratch, error) {
	mem, err := syscall.Mmap(-1, 0, int(size), syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_PRIVATE|syscall.MAP_ANON)
	if err != nil {
		return nil, fmt.Errorf("scratch of %d bytes: %v", size, err)
	}
	s := &scratch{p: p, mem: mem, addr: memory.AddrOf(mem)}
	if p.ops.Register != nil {
		if err := p.ops.Register(s.addr, size); err != nil {
			syscall.Munmap(mem)
			return nil, fmt.Errorf("the engine refused to register %d bytes of read-back scratch: %w", size, err)
		}
	}
	return s, nil
}

func (s *scratch) hold() {
	s.mu.Lock()
	s.users++
	s.mu.Unlock()
}

func (s *scratch) release() {
	s.mu.Lock()
	s.users--
	free := s.dropped && s.users == 0
	s.mu.Unlock()
	if free {
		s.free()
	}
}

func (s *scratch) drop() {
	s.mu.Lock()
	s.dropped = true
	free := s.users == 0
	s.mu.Unlock()
	if free {
		s.free()
	}
}

func (s *scratch) free() {
	if s.p.ops.Unregister != nil {
		if err := s.p.ops.Unregister(s.addr); err != nil {
			// Leak it rather than unmap memory the engine may still use.
			return
		}
	}
	syscall.Munmap(s.mem)
}
