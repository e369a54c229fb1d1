package tcp

import (
	"bufio"
	"crypto/rand"
	"io"
	"time"

	"github.com/mcguard/mcguard/core/transport"
	"github.com/mcguard/mcguard/core/wire"
)

// The serve loop of one data connection: its challenge, the deadline on
// each frame, a handler per request op, and its reply.

// readBuffer is a connection's read buffer at the target: frame headers,
// small payloads and the start of large ones (streamSource reads their
// rest past it).
const readBuffer = 256 << 10

// served is one data connection as its serve loop sees it.
type served struct {
	t         *target
	l         *link
	r         *bufio.Reader
	raw       io.Reader // r's own reader (streamSource)
	w         *bufio.Writer
	hdr       []byte
	challenge []byte // the hello must prove the handshake's key over it
	bound     bool   // a valid hello was taken
	lagged    *transport.Pending
	cut       func()    // closes the connection: unregistering a region it is in the middle of
	armed     time.Time // when the frame deadline was set; zero: waiting idle
}

// outcome is what a handler replies: its status, its length (a read-back's
// bytes, a prove's slot), its address (a request's own, but for a
// prove's) and the bytes that follow, if any.
type outcome struct {
	st      wire.Status
	n, addr uint64
	payload func(io.Writer) error
}

// handler serves one request frame whose header is h; an error ends the
// connection.
type handler func(s *served, h wire.Header) (outcome, error)

// handlers are the requests a bound connection may make, by op (a hello
// is served before any other).
var handlers [wire.OpWriteFromDevice + 1]handler

func init() {
	handlers[wire.OpMark] = (*served).mark
	handlers[wire.OpWrite] = (*served).write
	handlers[wire.OpWriteFrom] = (*served).writeFrom
	handlers[wire.OpWriteFromDevice] = (*served).writeFromDevice
	handlers[wire.OpProve] = (*served).prove
	handlers[wire.OpFence] = (*served).fence
	handlers[wire.OpRead] = (*served).read
	handlers[wire.OpNotice] = (*served).notice
}

// serve runs one data connection until it fails or the peer leaves. A
// malformed header ends the connection: the stream cannot be resynchronised.
func (t *target) serve(l *link) {
	defer t.wg.Done()
	defer t.release(l)
	raw := spinning(l.c, t.busyPoll, &t.spins, t.spun)
	s := &served{t: t, l: l, r: bufio.NewReaderSize(raw, readBuffer), raw: raw,
		w: bufio.NewWriterSize(l.c, 64<<10), hdr: make([]byte, wire.HeaderSize), lagged: transport.NewPending(),
		cut: func() { l.c.Close() }}
	if s.sendChallenge() != nil {
		return
	}
	for {
		h, err := s.next()
		if err != nil {
			return
		}
		var a outcome
		switch {
		case h.Op == wire.OpHello:
			a = s.hello(h)
		case !s.bound:
			a.st = wire.StatusUnauthorized
		case int(h.Op) < len(handlers) && handlers[h.Op] != nil:
			a, err = handlers[h.Op](s, h)
		}
		if err != nil {
			return
		}
		if a.st != wire.StatusOK && t.refused != nil {
			t.refused(refusalNames[a.st])
		}
		// Replies wait in the buffer while more frames are already here
		// (a batch's acknowledgements, a fence's before its read), except
		// a read-back's: the sender waits for it, and the frames behind it
		// may be the next chunk's writes (posted ahead), which would hold
		// it back until they are all applied.
		flush := s.r.Buffered() == 0 || h.Op == wire.OpHello || h.Op == wire.OpRead
		err = t.reply(l, s.w, s.hdr, wire.Header{Op: h.Op | wire.Reply, Status: a.st, ID: h.ID, Addr: a.addr, Len: a.n}, a.payload, flush)
		l.rd.done() // a quiesce of its ranges waits no longer
		if err != nil {
			return
		}
		if h.Op == wire.OpHello && a.st == wire.StatusOK {
			t.bindLink(l, h.Addr) // after the hello's reply: a mark it needs follows it
		}
		if a.st == wire.StatusUnauthorized {
			return
		}
	}
}

// sendChallenge sends the connection's fresh challenge: a hello seen on
// the wire is worth nothing on another connection.
func (s *served) sendChallenge() error {
	s.challenge = make([]byte, wire.ChallengeSize)
	rand.Read(s.challenge)
	s.l.c.SetWriteDeadline(time.Now().Add(s.t.timeout))
	wire.Header{Op: wire.OpChallenge, Len: wire.ChallengeSize}.Encode(s.hdr)
	s.l.wmu.Lock()
	defer s.l.wmu.Unlock()
	_, err := s.l.c.Write(append(append([]byte(nil), s.hdr...), s.challenge...))
	return err
}

// next reads the next frame's header. An idle, reused connection may
// wait for it as long as it likes; once a frame begins, all of it must
// come in time (no slowloris), and a stranger must say hello in time.
func (s *served) next() (wire.Header, error) {
	c := s.l.c
	if s.bound && s.r.Buffered() == 0 {
		c.SetReadDeadline(time.Time{})
		s.armed = time.Time{}
		if _, err := s.r.Peek(1); err != nil {
			return wire.Header{}, err
		}
	}
	// Frames back to back (the next already buffered) keep the deadline
	// set for an earlier one if it is recent: two deadline changes per
	// 4 KiB frame were a tenth of the target's time.
	if now := time.Now(); s.armed.IsZero() || now.Sub(s.armed) > s.t.timeout/8 {
		c.SetDeadline(now.Add(s.t.timeout))
		s.armed = now
	}
	if _, err := io.ReadFull(s.r, s.hdr); err != nil {
		return wire.Header{}, err
	}
	h, err := wire.Decode(s.hdr)
	if err == nil && h.Op&wire.Reply != 0 {
		err = wire.ErrFrame
	}
	return h, err
}

// release lets go of a connection that ended: its place among the
// sender's connections, its lease slot, and, the sender's last
// connection gone, its GPU memory mapped here.
func (t *target) release(l *link) {
	t.mu.Lock()
	if t.conns != nil {
		delete(t.conns, l.c)
	}
	for id, sc := range t.senders {
		if sc == l.c {
			delete(t.senders, id)
		}
	}
	last := l.pid != 0
	for _, o := range t.conns {
		last = last && o.pid != l.pid
	}
	t.mu.Unlock()
	l.c.Close()
	if slot := int(l.ring.slot.Load()); slot >= 0 {
		t.lease.Release(slot, func() { t.setRingSlot(l, -1) })
	}
	if gpu := t.regions.GPU(); last && gpu != nil {
		t.ipcs.Drop(gpu, l.pid)
	}
}

func (s *served) hello(h wire.Header) outcome {
	st, sender := s.t.hello(s.l, s.r, h.Len, s.challenge)
	if st == wire.StatusOK && (h.Status < 0 || h.Status >= MaxStripes) {
		st = wire.StatusBadRequest // no such stripe
	}
	s.bound = st == wire.StatusOK
	if s.bound {
		s.l.greeted.Store(true)
		s.t.claim(sender, int(h.Status), s.l)
	}
	return outcome{st: st, addr: h.Addr}
}

// mark takes a sender's echo of a quiesce generation, or with MarkLower
// the generation a transfer carried on here began under.
func (s *served) mark(h wire.Header) (outcome, error) {
	if h.Status == wire.MarkLower {
		s.l.lower(h.Addr)
	} else {
		s.l.catchUp(h.Addr, s.t.q.gen.Load())
	}
	if h.Len != 0 {
		_, err := io.CopyN(io.Discard, s.r, int64(h.Len))
		return outcome{st: wire.StatusBadRequest, addr: h.Addr}, err
	}
	return outcome{addr: h.Addr}, nil
}

func (s *served) write(h wire.Header) (outcome, error) {
	s.l.stream = streamSource{s.r, s.raw, h.Len} // passed by pointer: no allocation per write
	st, err := s.t.write(s.l, h.Addr, h.Len, &s.l.stream, s.lagged, s.cut, h.Status)
	return outcome{st: st, addr: h.Addr}, err
}

func (s *served) writeFrom(h wire.Header) (outcome, error) {
	src, st, err := s.t.pullSource(s.l, s.r, h.Len)
	if err == nil && st == wire.StatusOK {
		st, err = s.t.write(s.l, h.Addr, src.n, src, s.lagged, s.cut, h.Status)
	}
	return outcome{st: st, addr: h.Addr}, err
}

func (s *served) writeFromDevice(h wire.Header) (outcome, error) {
	src, st, err := s.t.pullDevice(s.l, s.r, h.Addr, h.Len)
	if err == nil && st == wire.StatusOK {
		st, err = s.t.write(s.l, h.Addr, src.n, src, s.lagged, s.cut, h.Status)
		src.release()
	}
	return outcome{st: st, addr: h.Addr}, err
}

func (s *served) prove(h wire.Header) (outcome, error) {
	st, n, epoch, err := s.t.prove(s.l, h.Addr, h.Len, s.r)
	return outcome{st: st, n: n, addr: epoch}, err
}

func (s *served) fence(h wire.Header) (outcome, error) {
	st, err := s.t.fence(s.r, h.Len, s.lagged)
	return outcome{st: st, addr: h.Addr}, err
}

func (s *served) read(h wire.Header) (outcome, error) {
	st, n, payload, err := s.t.read(s.l, s.r, h.Len, s.cut)
	return outcome{st: st, n: n, addr: h.Addr, payload: payload}, err
}

func (s *served) notice(h wire.Header) (outcome, error) {
	st, err := s.t.takeNotice(s.l, s.r, h.Len)
	return outcome{st: st, addr: h.Addr}, err
}
