package tcp

import (
	"io"
	"net"
	"runtime"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/mcguard/mcguard/core/transport"
)

// Busy polling (busy_poll_us). On a virtual machine a thread asleep in the
// kernel takes tens of µs to wake: a C socket pair between two processes
// here, 4 KiB and a one-byte answer, took 75 µs with blocking reads, 24
// with the sender spinning and 10 with both ends spinning. So a reader
// that expects bytes soon first tries non-blocking reads for a short
// budget, as UCX and NCCL poll their completions, and only then sleeps.
// The sender spins waiting for an answer (pollReader); the target spins
// waiting for the next frame while its connection is busy.

// MaxBusyPoll bounds busy_poll_us: a spin is a wait no deadline checks.
const MaxBusyPoll = time.Millisecond

// spinner is one reader's busy polling: non-blocking reads for up to
// budget, while spinning pays (transport.SpinBackoff: a spin pays where
// the bytes came within three quarters of the budget). With another
// process keeping the other core of this two-core machine busy, spinning
// 50 µs without backing off took a round trip from 40 µs to 140.
type spinner struct {
	transport.SpinBackoff
	budget time.Duration
	counts *SpinCounts // nil: not counted
}

func newSpinner(budget time.Duration, counts *SpinCounts) spinner {
	return spinner{budget: min(budget, MaxBusyPoll), counts: counts}
}

// SpinCounts is what a transport's busy polling cost (stats): spins
// begun, those that paid, and the nanoseconds spent spinning.
type SpinCounts struct{ spins, paid, nanos atomic.Int64 }

// read reads fd into b without blocking, spinning for up to limit (and
// the budget) where nothing has come yet; EAGAIN if nothing came.
func (s *spinner) read(fd int, b []byte, limit time.Duration) (int, error) {
	n, err := syscall.Read(fd, b)
	if err != syscall.EAGAIN && err != syscall.EINTR || s.budget <= 0 || limit <= 0 {
		return n, err
	}
	if s.Skipping() {
		return 0, syscall.EAGAIN
	}
	budget := min(limit, s.budget)
	start := time.Now()
	for {
		spent := time.Since(start)
		if spent >= budget {
			break
		}
		if n, err = syscall.Read(fd, b); err != syscall.EAGAIN && err != syscall.EINTR {
			s.paid(transport.SpinPays(spent, s.budget), spent)
			return n, err
		}
	}
	s.paid(false, time.Since(start))
	return 0, syscall.EAGAIN
}

// paid records whether a spin paid (counts, back-off).
func (s *spinner) paid(ok bool, spent time.Duration) {
	if c := s.counts; c != nil {
		c.spins.Add(1)
		c.nanos.Add(int64(spent))
		if ok {
			c.paid.Add(1)
		}
	}
	s.Paid(ok)
}

// spinConn is the target's side of a data connection: its reads spin for
// budget before parking in the netpoller, while the connection is busy
// (its last parked wait was short) and one of the target's spin slots is
// free; otherwise it just parks.
type spinConn struct {
	net.Conn
	rc    syscall.RawConn
	spin  spinner
	slots *spinSlots
	// One spin's state, and the function that does it, made once: a read
	// allocates nothing.
	b        []byte
	n        int
	err      error
	spinNow  func(fd uintptr)
	lastWait time.Duration // how long the last parked read waited
}

// spinSlots bounds a target's connections spinning at once to half its
// Ps (at least one): a host with many busy senders keeps cores for the
// work itself.
type spinSlots struct{ n atomic.Int32 }

func (s *spinSlots) take() bool {
	if s.n.Add(1) <= int32(max(runtime.GOMAXPROCS(0)/2, 1)) {
		return true
	}
	s.n.Add(-1)
	return false
}

func (s *spinSlots) give() { s.n.Add(-1) }

// spinning is c with reads that spin for budget, where that can help: a
// socket, and more than one P (with one, the spinning goroutine would
// hold the only P that the bytes' sender in this process needs).
func spinning(c net.Conn, budget time.Duration, slots *spinSlots, counts *SpinCounts) net.Conn {
	sc, ok := c.(syscall.Conn)
	if !ok || budget <= 0 || runtime.GOMAXPROCS(0) < 2 {
		return c
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return c
	}
	s := &spinConn{Conn: c, rc: rc, spin: newSpinner(budget, counts), slots: slots}
	s.spinNow = s.spinOnce
	return s
}

func (s *spinConn) spinOnce(fd uintptr) { s.n, s.err = s.spin.read(int(fd), s.b, s.spin.budget) }

func (s *spinConn) Read(b []byte) (int, error) {
	// A read that is not to spin goes straight to the netpoller, whose
	// own read comes first: no second non-blocking read before it.
	if s.lastWait <= 4*s.spin.budget && len(b) > 0 && !s.spin.Skipping() && s.slots.take() {
		s.b = b
		err := s.rc.Control(s.spinNow)
		s.b = nil
		s.slots.give()
		switch {
		case err != nil: // closed: the conn's own read says so
		case s.err == nil && s.n == 0:
			return 0, io.EOF
		case s.err == nil:
			return s.n, nil
		case s.err != syscall.EAGAIN:
			return 0, &net.OpError{Op: "read", Net: "tcp", Err: s.err}
		}
	}
	start := time.Now()
	n, err := s.Conn.Read(b)
	s.lastWait = time.Since(start)
	return n, err
}
