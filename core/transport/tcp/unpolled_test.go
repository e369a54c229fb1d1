package tcp

import (
	"bytes"
	"crypto/sha256"
	"io"
	"net"
	"os"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/mcguard/mcguard/core/errs"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// unpolledPair is tcpPair with the dialled end taken out of the netpoller.
func unpolledPair(t *testing.T) (*unpolledConn, net.Conn) {
	u, a, _ := unpolledPairFrom(t)
	return u, a
}

// unpolledPairFrom is unpolledPair, and the dialled end's descriptor
// before it was taken out.
func unpolledPairFrom(t *testing.T) (*unpolledConn, net.Conn, int) {
	t.Helper()
	if runtime.GOMAXPROCS(0) < 2 {
		t.Skip("one P: connections stay in the netpoller")
	}
	d, a := tcpPair(t)
	was := connFD(t, d)
	u, ok := unpoll(d).(*unpolledConn)
	require.True(t, ok, "a TCP connection with several Ps is taken out of the netpoller")
	t.Cleanup(func() { u.Close() })
	return u, a, was
}

// epollWatches says whether fd is in any epoll set of this process
// (/proc/self/fdinfo of each eventpoll descriptor lists its "tfd"s).
func epollWatches(t *testing.T, fd int) bool {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	require.NoError(t, err)
	for _, e := range ents {
		link, err := os.Readlink("/proc/self/fd/" + e.Name())
		if err != nil || !strings.Contains(link, "eventpoll") {
			continue
		}
		info, err := os.ReadFile("/proc/self/fdinfo/" + e.Name())
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(info), "\n") {
			f := strings.Fields(line)
			if len(f) >= 2 && f[0] == "tfd:" && f[1] == strconv.Itoa(fd) {
				return true
			}
		}
	}
	return false
}

func connFD(t *testing.T, c net.Conn) int {
	t.Helper()
	rc, err := c.(syscall.Conn).SyscallConn()
	require.NoError(t, err)
	fd := -1
	require.NoError(t, rc.Control(func(s uintptr) { fd = int(s) }))
	return fd
}

func TestUnpolledConnIsOutOfTheNetpoller(t *testing.T) {
	u, a, was := unpolledPairFrom(t)
	require.True(t, epollWatches(t, connFD(t, a)), "the accepted end is Go's: in the netpoller (the check sees it)")
	require.NotEqual(t, was, u.fd)
	require.False(t, epollWatches(t, was), "Go's descriptor of the dialled end is gone from the netpoller")
	require.False(t, epollWatches(t, u.fd), "the duplicate it left is in no epoll set")

	// It still moves bytes both ways.
	_, err := u.Write([]byte("ping"))
	require.NoError(t, err)
	buf := make([]byte, 4)
	_, err = io.ReadFull(a, buf)
	require.NoError(t, err)
	require.Equal(t, "ping", string(buf))
	_, err = a.Write([]byte("pong"))
	require.NoError(t, err)
	_, err = io.ReadFull(u, buf)
	require.NoError(t, err)
	require.Equal(t, "pong", string(buf))
}

func TestUnpollKeepsWhatItCannotServe(t *testing.T) {
	p1, p2 := net.Pipe()
	defer p1.Close()
	defer p2.Close()
	require.Equal(t, p1, unpoll(p1), "not a TCP socket")

	d, _ := tcpPair(t)
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(1))
	require.Equal(t, d, unpoll(d), "one P: the netpoller serves better")
}

func TestUnpolledConnDeadlines(t *testing.T) {
	u, _ := unpolledPair(t)
	require.NoError(t, u.SetReadDeadline(time.Now().Add(20*time.Millisecond)))
	_, err := u.Read(make([]byte, 1))
	require.ErrorIs(t, err, os.ErrDeadlineExceeded, "nothing comes: the read deadline passes")

	// The peer reads nothing: the socket's buffers fill, and the write
	// waits for room until its deadline.
	require.NoError(t, unix.SetsockoptInt(u.fd, unix.SOL_SOCKET, unix.SO_SNDBUF, 4096))
	require.NoError(t, u.SetWriteDeadline(time.Now().Add(50*time.Millisecond)))
	n, err := u.Write(make([]byte, 64<<20))
	require.ErrorIs(t, err, os.ErrDeadlineExceeded)
	require.Less(t, n, 64<<20)
	require.ErrorIs(t, ioErr("send", err), errs.Timeout, "a deadline is a timeout to the transfer")
}

func TestUnpolledConnCloseEndsWaitingReadsAndWrites(t *testing.T) {
	u, a := unpolledPair(t)
	require.NoError(t, unix.SetsockoptInt(u.fd, unix.SOL_SOCKET, unix.SO_SNDBUF, 4096))
	readErr, writeErr := make(chan error, 1), make(chan error, 1)
	go func() {
		_, err := u.Read(make([]byte, 1))
		readErr <- err
	}()
	go func() {
		_, err := u.Write(make([]byte, 64<<20)) // the peer reads nothing: it waits for room
		writeErr <- err
	}()
	// Both hold the descriptor before Close: each is waiting in poll(2)
	// or about to (a wait looks at Close first), never refused at entry.
	require.Eventually(t, func() bool { return u.state.Load() == 2 }, 10*time.Second, time.Millisecond)
	require.NoError(t, u.Close())
	require.NoError(t, u.Close(), "a second Close is harmless")
	for name, ch := range map[string]chan error{"read": readErr, "write": writeErr} {
		select {
		case err := <-ch:
			require.Error(t, err, name)
		case <-time.After(10 * time.Second):
			t.Fatalf("the %s still waits after Close", name)
		}
	}
	_, err := u.Write([]byte("x"))
	require.ErrorIs(t, err, net.ErrClosed)
	_, err = u.Read(make([]byte, 1))
	require.ErrorIs(t, err, net.ErrClosed)
	rc, err := u.SyscallConn()
	require.NoError(t, err)
	require.ErrorIs(t, rc.Control(func(uintptr) {}), net.ErrClosed)

	// The socket is closed: the peer reads what was sent, then the end.
	a.SetReadDeadline(time.Now().Add(10 * time.Second))
	_, err = io.Copy(io.Discard, a)
	require.NoError(t, err, "the peer sees the end of the stream")
}

func TestUnpolledConnLingerZeroResets(t *testing.T) {
	u, a := unpolledPair(t)
	_, err := u.Write([]byte("sent")) // nothing unread on u's side: only linger 0 makes the close a reset
	require.NoError(t, err)
	require.NoError(t, u.SetLinger(0))
	require.NoError(t, u.Close())
	a.SetReadDeadline(time.Now().Add(10 * time.Second))
	_, err = io.Copy(io.Discard, a)
	require.ErrorIs(t, err, syscall.ECONNRESET)
}

func TestUnpolledConnWriteBuffers(t *testing.T) {
	u, a := unpolledPair(t)
	require.NoError(t, unix.SetsockoptInt(u.fd, unix.SOL_SOCKET, unix.SO_SNDBUF, 4096)) // short writes, waits for room
	var bufs net.Buffers
	var all bytes.Buffer
	for i := range 3000 { // more than one writev's maxIOV
		b := bytes.Repeat([]byte{byte(i)}, i%97)
		if i%500 == 0 {
			b = bytes.Repeat([]byte{byte(i)}, 256<<10)
		}
		bufs = append(bufs, b)
		all.Write(b)
	}
	got := make(chan []byte, 1)
	go func() {
		b, _ := io.ReadAll(a)
		got <- b
	}()
	require.NoError(t, u.SetWriteDeadline(time.Now().Add(30*time.Second)))
	n, err := writeBuffers(u, &bufs)
	require.NoError(t, err)
	require.EqualValues(t, all.Len(), n)
	require.Empty(t, bufs, "consumed")
	require.NoError(t, u.Close())
	b := <-got
	require.Equal(t, sha256.Sum256(all.Bytes()), sha256.Sum256(b), "every byte, in order")
}

func TestUnpolledRawConnWaitsForEvents(t *testing.T) {
	u, a := unpolledPair(t)
	rc, err := u.SyscallConn()
	require.NoError(t, err)
	go func() {
		time.Sleep(20 * time.Millisecond)
		a.Write([]byte("x"))
	}()
	var got int
	require.NoError(t, u.SetReadDeadline(time.Now().Add(10*time.Second)))
	require.NoError(t, rc.Read(func(fd uintptr) bool {
		var b [1]byte
		n, _, err := syscall.Recvfrom(int(fd), b[:], syscall.MSG_DONTWAIT)
		got = n
		return err == nil
	}))
	require.Equal(t, 1, got, "Read called f again once the byte came")
	require.NoError(t, rc.Write(func(uintptr) bool { return true }))
}
