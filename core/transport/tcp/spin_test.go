package tcp

import (
	"io"
	"net"
	"os"
	"runtime"
	"testing"
	"time"

	"github.com/mcguard/mcguard/core/transport"
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
	s := spinning(r, 200*time.Microsecond, &spinSlots{}, nil).(*spinConn)
	buf := make([]byte, 8)

	go w.Write([]byte("spun")) // most often taken while spinning; else after parking
	n, err := io.ReadFull(s, buf[:4])
	require.NoError(t, err)
	require.Equal(t, "spun", string(buf[:n]))

	go func() { time.Sleep(30 * time.Millisecond); w.Write([]byte("parked")) }()
	n, err = io.ReadFull(s, buf[:6])
	require.NoError(t, err)
	require.Equal(t, "parked", string(buf[:n]))
	require.Greater(t, s.lastWait, 4*s.spin.budget, "waited in the netpoller")
	require.False(t, s.lastWait <= 4*s.spin.budget, "an idle connection's next read parks at once")

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

// A spin gives up after its budget with EAGAIN, having read nothing, and
// two empty spins in a row make the next waits skip spinning: 1, then 2,
// then 4.
func TestSpinnerBacksOff(t *testing.T) {
	w, r := tcpPair(t)
	rc, err := r.(*net.TCPConn).SyscallConn()
	require.NoError(t, err)
	var counts SpinCounts
	sp := newSpinner(time.Millisecond, &counts)
	buf := make([]byte, 4)
	spun := func() bool {
		var rerr error
		start := time.Now()
		require.NoError(t, rc.Control(func(fd uintptr) { _, rerr = sp.read(int(fd), buf, time.Hour) }))
		require.Error(t, rerr)
		return time.Since(start) >= time.Millisecond
	}
	var pattern []bool
	for range 11 {
		pattern = append(pattern, spun())
	}
	require.Equal(t, []bool{true, true, false, true, true, false, false, true, true, false, false}, pattern)
	require.EqualValues(t, 6, counts.spins.Load(), "skipped waits are not spins")
	require.Zero(t, counts.paid.Load())
	require.GreaterOrEqual(t, time.Duration(counts.nanos.Load()), 6*time.Millisecond)

	// (The back-off's rules themselves: transport.SpinBackoff's tests.)
	for sp.Skipping() {
	}

	// Bytes that come while spinning reset the back-off. The budget is
	// raised past MaxBusyPoll here so that the writer's sleep surely ends
	// within it. On a loaded machine the read may begin only after the
	// bytes came (no spin, nothing learnt): then it is tried again.
	sp.budget = 200 * time.Millisecond
	for attempt := 0; ; attempt++ {
		spins := counts.spins.Load()
		go func() { time.Sleep(time.Millisecond); w.Write([]byte("data")) }()
		for sp.Skipping() {
		}
		var n int
		var rerr error
		require.NoError(t, rc.Control(func(fd uintptr) { n, rerr = sp.read(int(fd), buf, time.Hour) }))
		require.NoError(t, rerr)
		require.Equal(t, 4, n)
		if counts.spins.Load() > spins {
			break // the bytes came during the spin
		}
		require.Less(t, attempt, 50, "the bytes always came before the read began")
	}
	require.Equal(t, transport.SpinBackoff{}, sp.SpinBackoff, "a spin that paid ends the back-off")
	require.EqualValues(t, 1, counts.paid.Load(), "this spin")
}
