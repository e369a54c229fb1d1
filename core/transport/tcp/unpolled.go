package tcp

import (
	"io"
	"net"
	"os"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// unpolledConn is a sender's data connection taken out of Go's netpoller
// once connected: pollReader reads it on the calling thread, and writes
// wait for room in poll(2), so no goroutine ever parks on it. Left in the
// netpoller, every answer that arrives wakes the runtime thread asleep in
// epoll_wait (the socket is registered edge-triggered: one event per
// arrival) although nothing waits there; on a small machine that thread
// takes the CPU of the caller spinning for the answer, and a 4 KiB
// transfer over sockets took 35–48 µs in some runs instead of 18
// (docs/PERFORMANCE.md).
//
// The descriptor is closed once, by the last operation using it when
// Close comes (so its number cannot be reused under a read). Reads, and
// writes, are each one goroutine's at a time, as the connection's users
// have them.
type unpolledConn struct {
	fd           int
	state        atomic.Int64 // operations using fd, and closedBit
	rdl, wdl     atomic.Int64 // read and write deadlines, Unix ns (0: none)
	linger       atomic.Bool  // Close resets the connection (SetLinger(0))
	laddr, raddr net.Addr
	iov          []unix.Iovec // writeBuffers' scratch (the one writer's)
}

const closedBit = int64(1) << 62

// unpoll takes c out of the netpoller where that serves: a TCP socket,
// where the caller's thread polls (callerPolls). Otherwise, or if it
// fails, c is returned.
func unpoll(c net.Conn) net.Conn {
	tc, ok := c.(*net.TCPConn)
	if !ok || !callerPolls() {
		return c
	}
	rc, err := tc.SyscallConn()
	if err != nil {
		return c
	}
	fd := -1
	if cerr := rc.Control(func(s uintptr) { fd, err = unix.FcntlInt(s, unix.F_DUPFD_CLOEXEC, 0) }); cerr != nil || err != nil {
		return c
	}
	// Closing the original takes it out of the netpoller; the duplicate
	// keeps the socket, and its non-blocking mode (the file's, shared).
	u := &unpolledConn{fd: fd, laddr: c.LocalAddr(), raddr: c.RemoteAddr()}
	c.Close()
	return u
}

// use admits an operation on fd; false once closed.
func (u *unpolledConn) use() bool {
	for {
		s := u.state.Load()
		if s&closedBit != 0 {
			return false
		}
		if u.state.CompareAndSwap(s, s+1) {
			return true
		}
	}
}

// done ends an operation; the last one after Close closes fd.
func (u *unpolledConn) done() {
	if u.state.Add(-1) == closedBit {
		u.closeFD()
	}
}

func (u *unpolledConn) closeFD() {
	if u.linger.Load() {
		unix.SetsockoptLinger(u.fd, unix.SOL_SOCKET, unix.SO_LINGER, &unix.Linger{Onoff: 1, Linger: 0})
	}
	unix.Close(u.fd)
}

// Close ends the connection; it may be called from any goroutine, and
// more than once. A read waiting in poll(2) meanwhile wakes at once (the
// socket's receiving side is shut: no FIN, so unsent bytes are not
// flushed to the peer because of it), a write waiting for room within
// pollSlice, as pollReader's own polls do; the last of them closes fd.
func (u *unpolledConn) Close() error {
	if !u.use() {
		return nil // closed already
	}
	if prev := u.state.Or(closedBit); prev&closedBit == 0 && prev > 1 {
		unix.Shutdown(u.fd, unix.SHUT_RD)
	}
	u.done()
	return nil
}

// SetLinger with sec 0 makes Close reset the connection, as
// (*net.TCPConn).SetLinger does; other values keep the default close.
func (u *unpolledConn) SetLinger(sec int) error {
	u.linger.Store(sec == 0)
	return nil
}

func (u *unpolledConn) LocalAddr() net.Addr  { return u.laddr }
func (u *unpolledConn) RemoteAddr() net.Addr { return u.raddr }

func (u *unpolledConn) SetDeadline(t time.Time) error {
	u.SetReadDeadline(t)
	return u.SetWriteDeadline(t)
}

func (u *unpolledConn) SetReadDeadline(t time.Time) error {
	u.rdl.Store(deadlineNanos(t))
	return nil
}

func (u *unpolledConn) SetWriteDeadline(t time.Time) error {
	u.wdl.Store(deadlineNanos(t))
	return nil
}

func deadlineNanos(t time.Time) int64 {
	if t.IsZero() {
		return 0
	}
	return t.UnixNano()
}

// wait polls fd for events until the deadline (Unix ns, 0: none), in
// slices of pollSlice so that a Close, or a deadline moved meanwhile, is
// seen even where the shutdown woke nothing.
func (u *unpolledConn) wait(events int16, dl *atomic.Int64) error {
	fds := [1]unix.PollFd{{Fd: int32(u.fd), Events: events}}
	for {
		if u.state.Load()&closedBit != 0 {
			return net.ErrClosed
		}
		wait := pollSlice
		if deadline := dl.Load(); deadline != 0 {
			left := time.Duration(deadline - time.Now().UnixNano())
			if left <= 0 {
				return os.ErrDeadlineExceeded
			}
			wait = min(wait, left)
		}
		n, err := unix.Poll(fds[:], int(wait.Milliseconds())+1)
		if n > 0 || err != nil && err != unix.EINTR {
			return err
		}
	}
}

// retry holds fd for op and runs it until it neither would block nor
// was interrupted, waiting in poll(2) for events (until the deadline in
// dl) between tries; it returns op's last error, or the wait's.
func (u *unpolledConn) retry(events int16, dl *atomic.Int64, op func(fd int) error) error {
	if !u.use() {
		return net.ErrClosed
	}
	defer u.done()
	for {
		switch err := op(u.fd); err {
		case unix.EINTR:
		case unix.EAGAIN:
			if err := u.wait(events, dl); err != nil {
				return err
			}
		default:
			return err
		}
	}
}

// syscallErr names the call an errno came from; the connection's own
// errors (closed, past the deadline) are returned as they are.
func syscallErr(call string, err error) error {
	if errno, ok := err.(syscall.Errno); ok {
		return os.NewSyscallError(call, errno)
	}
	return err
}

// Read reads into b, waiting in poll(2) for bytes.
func (u *unpolledConn) Read(b []byte) (n int, err error) {
	err = u.retry(unix.POLLIN, &u.rdl, func(fd int) (err error) {
		n, err = syscall.Read(fd, b)
		return err
	})
	switch {
	case err != nil:
		return 0, syscallErr("read", err)
	case n == 0 && len(b) > 0:
		return 0, io.EOF
	}
	return n, nil
}

// Write writes all of b, waiting in poll(2) for room. It writes with
// syscall.Write, as Go's own sockets do: the race detector takes a write
// there and a read of the bytes elsewhere (syscall.Read) as ordered.
func (u *unpolledConn) Write(b []byte) (done int, err error) {
	for done < len(b) {
		err = u.retry(unix.POLLOUT, &u.wdl, func(fd int) error {
			n, err := syscall.Write(fd, b[done:])
			done += max(n, 0)
			return err
		})
		if err != nil {
			return done, syscallErr("write", err)
		}
	}
	return done, nil
}

// writeBuffers writes every byte of bufs by writev, as net.Buffers'
// WriteTo does for Go's own sockets (it writes buffer by buffer to any
// other writer), consuming bufs.
func (u *unpolledConn) writeBuffers(bufs *net.Buffers) (total int64, err error) {
	defer clear(u.iov[:cap(u.iov)]) // let go of the buffers
	for len(*bufs) > 0 {
		u.iov = u.iov[:0]
		for _, b := range *bufs {
			if len(u.iov) == maxIOV {
				break
			}
			if len(b) > 0 {
				u.iov = append(u.iov, unix.Iovec{Base: &b[0], Len: uint64(len(b))})
			}
		}
		if len(u.iov) == 0 {
			*bufs = (*bufs)[:0]
			break
		}
		var wrote uintptr
		err = u.retry(unix.POLLOUT, &u.wdl, func(fd int) error {
			r, _, e := unix.Syscall(unix.SYS_WRITEV, uintptr(fd), uintptr(unsafe.Pointer(&u.iov[0])), uintptr(len(u.iov)))
			if e != 0 {
				return e
			}
			wrote = r
			return nil
		})
		if err != nil {
			return total, syscallErr("writev", err)
		}
		total += int64(wrote)
		consume(bufs, int64(wrote))
	}
	return total, nil
}

// consume drops n written bytes from the front of bufs.
func consume(bufs *net.Buffers, n int64) {
	for len(*bufs) > 0 {
		first := int64(len((*bufs)[0]))
		if first > n {
			(*bufs)[0] = (*bufs)[0][n:]
			return
		}
		n -= first
		*bufs = (*bufs)[1:]
	}
}

// maxIOV is the most buffers one writev takes (Linux's IOV_MAX).
const maxIOV = 1024

// writeBuffers sends bufs whole, by writev where c can.
func writeBuffers(c net.Conn, bufs *net.Buffers) (int64, error) {
	if u, ok := c.(*unpolledConn); ok {
		return u.writeBuffers(bufs)
	}
	return bufs.WriteTo(c)
}

// SyscallConn gives pollReader and the peek the socket.
func (u *unpolledConn) SyscallConn() (syscall.RawConn, error) { return unpolledRaw{u}, nil }

// unpolledRaw is the connection's syscall.RawConn.
type unpolledRaw struct{ u *unpolledConn }

func (r unpolledRaw) Control(f func(fd uintptr)) error {
	if !r.u.use() {
		return net.ErrClosed
	}
	defer r.u.done()
	f(uintptr(r.u.fd))
	return nil
}

func (r unpolledRaw) Read(f func(fd uintptr) bool) error {
	return r.loop(f, unix.POLLIN, &r.u.rdl)
}

func (r unpolledRaw) Write(f func(fd uintptr) bool) error {
	return r.loop(f, unix.POLLOUT, &r.u.wdl)
}

// loop calls f until it says it is done, waiting for events between calls.
func (r unpolledRaw) loop(f func(fd uintptr) bool, events int16, deadline *atomic.Int64) error {
	return r.u.retry(events, deadline, func(fd int) error {
		if f(uintptr(fd)) {
			return nil
		}
		return unix.EAGAIN
	})
}
