package tcp

import (
	"io"
	"net"
	"os"
	"runtime"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// tcpPair is a connected loopback TCP pair.
func tcpPair(t *testing.T) (a, b net.Conn) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	acc := make(chan net.Conn, 1)
	go func() {
		c, _ := ln.Accept()
		acc <- c
	}()
	a, err = net.Dial("tcp", ln.Addr().String())
	require.NoError(t, err)
	b = <-acc
	require.NotNil(t, b)
	t.Cleanup(func() { a.Close(); b.Close() })
	return a, b
}

// A spinning reader gets what was written while it spun, what comes
// after it gave up and parked, the end of the stream, and a deadline.
func TestSpinConnReads(t *testing.T) {
	if runtime.GOMAXPROCS(0) < 2 {
		t.Skip("one P: reads do not spin")
	}
	w, r := tcpPair(t)
	s := spinning(r, 200*time.Microsecond).(*spinConn)
	buf := make([]byte, 8)

	go w.Write([]byte("spun")) // most often taken while spinning; else after parking
	n, err := io.ReadFull(s, buf[:4])
	require.NoError(t, err)
	require.Equal(t, "spun", string(buf[:n]))

	go func() { time.Sleep(30 * time.Millisecond); w.Write([]byte("parked")) }()
	n, err = io.ReadFull(s, buf[:6])
	require.NoError(t, err)
	require.Equal(t, "parked", string(buf[:n]))
	require.Greater(t, s.lastWait, 4*s.budget, "waited in the netpoller")
	require.False(t, s.lastWait <= 4*s.budget, "an idle connection's next read parks at once")

	require.NoError(t, s.SetReadDeadline(time.Now().Add(20*time.Millisecond)))
	_, err = s.Read(buf)
	require.ErrorIs(t, err, os.ErrDeadlineExceeded, "a deadline still ends a parked read")
	require.NoError(t, s.SetReadDeadline(time.Time{}))

	s.lastWait = 0 // busy again: spin, and see the end of the stream while spinning
	w.Close()
	_, err = s.Read(buf)
	require.ErrorIs(t, err, io.EOF)

	s.Close()
	_, err = s.Read(buf)
	require.Error(t, err, "a closed connection reads nothing")
}

// spinRead gives up after its budget with EAGAIN, having read nothing.
func TestSpinReadBudget(t *testing.T) {
	_, r := tcpPair(t)
	rc, err := r.(*net.TCPConn).SyscallConn()
	require.NoError(t, err)
	var n int
	var rerr error
	start := time.Now()
	require.NoError(t, rc.Control(func(fd uintptr) { n, rerr = spinRead(int(fd), make([]byte, 4), time.Millisecond) }))
	require.GreaterOrEqual(t, time.Since(start), time.Millisecond)
	require.Zero(t, n)
	require.Error(t, rerr)
}

// Busy polling off, or nothing to poll: the connection as it was.
func TestSpinningOff(t *testing.T) {
	_, r := tcpPair(t)
	require.Same(t, r, spinning(r, 0))
	p1, p2 := net.Pipe()
	defer p1.Close()
	defer p2.Close()
	require.Equal(t, p1, spinning(p1, time.Millisecond), "not a socket")
}
