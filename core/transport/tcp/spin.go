package tcp

import (
	"io"
	"net"
	"runtime"
	"syscall"
	"time"
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

// spinRead tries non-blocking reads of fd into b until one gives bytes, an
// error other than EAGAIN, or budget has passed (EAGAIN then).
func spinRead(fd int, b []byte, budget time.Duration) (int, error) {
	n, err := syscall.Read(fd, b)
	if err != syscall.EAGAIN && err != syscall.EINTR || budget <= 0 {
		return n, err
	}
	start := time.Now()
	for time.Since(start) < budget {
		if n, err = syscall.Read(fd, b); err != syscall.EAGAIN && err != syscall.EINTR {
			return n, err
		}
	}
	return 0, syscall.EAGAIN
}

// spinConn is the target's side of a data connection: its reads spin for
// budget before parking in the netpoller, while the connection is busy
// (its last parked wait was short); an idle connection just parks.
type spinConn struct {
	net.Conn
	rc     syscall.RawConn
	budget time.Duration
	// One spin's state, and the function that does it, made once: a read
	// allocates nothing.
	b        []byte
	n        int
	err      error
	spinNow  func(fd uintptr)
	lastWait time.Duration // how long the last parked read waited
}

// spinning is c with reads that spin for budget, where that can help: a
// socket, and more than one P (with one, the spinning goroutine would
// hold the only P that the bytes' sender in this process needs).
func spinning(c net.Conn, budget time.Duration) net.Conn {
	sc, ok := c.(syscall.Conn)
	if !ok || budget <= 0 || runtime.GOMAXPROCS(0) < 2 {
		return c
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return c
	}
	s := &spinConn{Conn: c, rc: rc, budget: min(budget, MaxBusyPoll)}
	s.spinNow = s.spin
	return s
}

func (s *spinConn) spin(fd uintptr) { s.n, s.err = spinRead(int(fd), s.b, s.budget) }

func (s *spinConn) Read(b []byte) (int, error) {
	if s.lastWait <= 4*s.budget && len(b) > 0 {
		s.b = b
		err := s.rc.Control(s.spinNow)
		s.b = nil
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
