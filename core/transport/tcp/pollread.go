package tcp

import (
	"errors"
	"fmt"
	"io"
	"os"
	"runtime"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// pollReader reads a sender's connection on the calling thread: a
// non-blocking read, and where nothing has come yet, poll(2) on the socket,
// so the thread sleeps in the kernel and wakes itself. Go's own read would
// park the goroutine in the netpoller instead; when the caller is a C
// thread (every mc_guard_transfer), its goroutine is locked to that thread
// and each park and wake is a hand-off between threads, tens of µs each
// way: most of a small transfer's time.
type pollReader struct {
	rc    syscall.RawConn
	until *time.Time // the connection's deadline, as conn.deadline set it
	spin  spinner    // busy polling before poll(2) (spin.go)
	// spinFor is how long this read may still spin: the wait's first
	// attempt spins, those after a poll(2) woke or timed out do not.
	spinFor time.Duration
	// One read's state, and the function that does it, made once: a read
	// allocates nothing.
	b       []byte
	n       int
	rerr    error
	wait    time.Duration
	fds     []unix.PollFd
	readNow func(fd uintptr)
}

// pollSlice bounds one poll: a connection closed meanwhile (a cancel, the
// guard closing) is noticed within it.
const pollSlice = 10 * time.Millisecond

// read is one read of p.b, spinning for up to p.spinFor, and where nothing
// has come, one poll.
func (p *pollReader) read(fd uintptr) {
	p.n, p.rerr = p.spin.read(int(fd), p.b, p.spinFor)
	p.spinFor = 0
	if p.rerr != syscall.EAGAIN {
		return
	}
	p.fds[0] = unix.PollFd{Fd: int32(fd), Events: unix.POLLIN}
	_, p.rerr = unix.Poll(p.fds, int(min(p.wait, pollSlice).Milliseconds())+1)
	if p.rerr == nil || p.rerr == syscall.EINTR {
		p.rerr = syscall.EAGAIN // read again
	}
}

func (p *pollReader) Read(b []byte) (int, error) {
	defer func() { p.b = nil }()
	p.spinFor = MaxBusyPoll // the spinner's budget bounds it
	for {
		p.wait = time.Until(*p.until)
		p.spinFor = min(p.spinFor, p.wait)
		if p.wait <= 0 {
			return 0, fmt.Errorf("read: %w", os.ErrDeadlineExceeded)
		}
		p.b = b
		err := p.rc.Control(p.readNow)
		n, rerr := p.n, p.rerr
		switch {
		case err != nil: // closed
			return 0, err
		case rerr == syscall.EAGAIN:
			continue
		case rerr == syscall.EINTR:
			continue
		case rerr != nil:
			return 0, rerr
		case n == 0 && len(b) > 0:
			return 0, io.EOF
		}
		return n, nil
	}
}

// callerPolls says whether a sender's connection is read (and waited on)
// by the calling thread in poll(2): where the process has more than one
// P. With one (GOMAXPROCS 1: a container limited to one CPU), a thread
// blocked in poll holds the only P until sysmon takes it back, and every
// other goroutine (this guard's target, its control channel) waits that
// long: 245 µs per 4 KiB transfer, measured, against 40 µs with the
// netpoller.
func callerPolls() bool { return runtime.GOMAXPROCS(0) >= 2 }

// readerOf is c's reader: a pollReader where c exposes its socket and the
// caller's thread polls (callerPolls).
func readerOf(c interface{}, until *time.Time, spin time.Duration, counts *SpinCounts) (io.Reader, error) {
	if !callerPolls() {
		return nil, errors.New("one P: the netpoller serves better")
	}
	sc, ok := c.(syscall.Conn)
	if !ok {
		return nil, errors.New("not a socket")
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return nil, err
	}
	p := &pollReader{rc: rc, until: until, spin: newSpinner(spin, counts), fds: make([]unix.PollFd, 1)}
	p.readNow = p.read
	return p, nil
}
