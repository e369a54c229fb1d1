package tcp

import (
	"bytes"
	"context"
	"io"
	"net"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/core/fault"
	"github.com/mcguard/mcguard/core/internal/testmem"
	"github.com/mcguard/mcguard/core/memory"
	"github.com/mcguard/mcguard/core/transport"
	"github.com/mcguard/mcguard/core/wire"
)

// exhausted is a listener whose first fails Accepts fail as a process out
// of file descriptors does.
type exhausted struct {
	net.Listener
	fails atomic.Int32
}

func (l *exhausted) Accept() (net.Conn, error) {
	if l.fails.Add(-1) >= 0 {
		return nil, &net.OpError{Op: "accept", Net: "tcp", Err: syscall.EMFILE}
	}
	return l.Listener.Accept()
}

// The landed version's accept loop returned on the first error, and the
// target never accepted a data connection again.
func TestAcceptSurvivesDescriptorExhaustion(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	flaky := &exhausted{Listener: ln}
	flaky.fails.Store(5)
	tg := serveOn(flaky, Config{Timeout: time.Second, Regions: memory.New(nil), Faults: fault.Config{Mode: fault.None},
		Tokens: func([]byte) (string, []byte, bool) { return "", nil, false }})
	defer tg.close()
	// The challenge, then a hello with a bad token: answers prove the
	// connection is served.
	c, _ := dialRaw(t, tg.addr())
	h := c.request(wire.OpHello, 1, make([]byte, wire.HelloSize))
	require.Equal(t, wire.StatusUnauthorized, h.Status)
	require.Less(t, flaky.fails.Load(), int32(0), "every injected error was met")
}

func TestProveRefusalsSayWhy(t *testing.T) {
	require.Contains(t, errnoText(0), "did not match")
	require.Contains(t, errnoText(wire.ProveNoGrant), "no same-host grant")
	require.Contains(t, errnoText(uint64(syscall.EPERM)), "operation not permitted")
}

// A read-back frame is answered with each range's bytes in order, across
// regions; one range outside registered memory refuses the whole frame
// before any byte goes out (checked once per frame, region by region).
func TestReadFramesAcrossRegions(t *testing.T) {
	base := memory.AddrOf(testmem.Pages(t, 3))
	regions := memory.New(nil)
	require.NoError(t, regions.Add(base, 4096))
	require.NoError(t, regions.Add(base+4096, 4096)) // the third page is not registered
	token, key := make([]byte, wire.TokenSize), []byte("key")
	tg := serveOn(mustListen(t), Config{Timeout: time.Second, Regions: regions, Faults: fault.Config{Mode: fault.None},
		Tokens: func(tok []byte) (string, []byte, bool) { return "sender", key, bytes.Equal(tok, token) }})
	defer tg.close()
	c, challenge := dialRaw(t, tg.addr())
	h := c.request(wire.OpHello, 1, append(append([]byte(nil), token...), transport.ConnectionProof(key, challenge)...))
	require.Equal(t, wire.StatusOK, h.Status)

	var ranges []byte
	for _, r := range [][2]uint64{{base, 3}, {base + 4096 + 5, 2}, {base + 100, 1}} {
		ranges = wire.AppendRange(ranges, r[0], r[1])
	}
	h = c.request(wire.OpRead, 2, ranges)
	require.Equal(t, wire.StatusOK, h.Status)
	got := make([]byte, h.Len)
	_, err := io.ReadFull(c, got)
	require.NoError(t, err)
	require.Equal(t, []byte{0, 0, 0, 1, 1, 0}, got, "in order, across regions and back")

	h = c.request(wire.OpRead, 3, wire.AppendRange(wire.AppendRange(nil, base, 8), base+2*4096, 8))
	require.Equal(t, wire.StatusNotRegistered, h.Status)
	require.Zero(t, h.Len, "no byte goes out")
}

// rawConn is a data connection driven frame by frame.
type rawConn struct {
	net.Conn
	t *testing.T
}

// dialRaw connects to a target and reads its challenge.
func dialRaw(t *testing.T, addr string) (rawConn, []byte) {
	c, err := net.DialTimeout("tcp", addr, time.Second)
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	c.SetDeadline(time.Now().Add(5 * time.Second))
	hello := make([]byte, wire.HeaderSize+wire.ChallengeSize)
	_, err = io.ReadFull(c, hello)
	require.NoError(t, err, "the target's challenge")
	return rawConn{c, t}, hello[wire.HeaderSize:]
}

// request sends one frame and reads its reply's header.
func (c rawConn) request(op wire.Op, id uint64, payload []byte) wire.Header {
	hdr := make([]byte, wire.HeaderSize)
	wire.Header{Op: op, ID: id, Len: uint64(len(payload))}.Encode(hdr)
	_, err := c.Write(append(hdr, payload...))
	require.NoError(c.t, err)
	_, err = io.ReadFull(c, hdr)
	require.NoError(c.t, err)
	h, err := wire.Decode(hdr)
	require.NoError(c.t, err)
	return h
}

func mustListen(t *testing.T) net.Listener {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	return ln
}

// At maxTargetConns a newcomer shuts the oldest connection that has not
// said a valid hello, never a bound sender's: strangers cannot keep an
// honest sender out, nor push one off.
func TestANewcomerShutsTheOldestStranger(t *testing.T) {
	token, key := make([]byte, wire.TokenSize), []byte("key")
	token[0] = 1
	tg := serveOn(mustListen(t), Config{Timeout: 5 * time.Second, Regions: memory.New(nil), Faults: fault.Config{Mode: fault.None},
		Tokens: func(tok []byte) (string, []byte, bool) { return "sender", key, bytes.Equal(tok, token) }})
	defer tg.close()
	bound, challenge := dialRaw(t, tg.addr())
	h := bound.request(wire.OpHello, 1, append(append([]byte(nil), token...), transport.ConnectionProof(key, challenge)...))
	require.Equal(t, wire.StatusOK, h.Status)
	strangers := make([]rawConn, maxTargetConns-1)
	for i := range strangers {
		strangers[i], _ = dialRaw(t, tg.addr())
	}
	for i := 0; i < 3; i++ {
		dialRaw(t, tg.addr()) // the challenge came: served
		strangers[i].SetReadDeadline(time.Now().Add(5 * time.Second))
		_, err := strangers[i].Read(make([]byte, 1))
		require.ErrorIs(t, err, io.EOF, "stranger %d, the oldest, was shut for it", i)
	}
	h = bound.request(wire.OpFence, 2, nil)
	require.Equal(t, wire.StatusOK, h.Status, "the bound sender's connection was kept")
}

// shutting is a listener that closes its first shut connections as it
// accepts them, as a target full of strangers shuts one for a newcomer.
type shutting struct {
	net.Listener
	shut atomic.Int32
}

func (l *shutting) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil || l.shut.Add(-1) < 0 {
			return c, err
		}
		c.Close()
	}
}

// A connection the target shut before it answered the hello is opened
// again (within the deadline), and a refused hello is not.
func TestDialTriesAgainWhereTheTargetShutTheConnection(t *testing.T) {
	token, key := make([]byte, wire.TokenSize), []byte("key")
	ln := &shutting{Listener: mustListen(t)}
	ln.shut.Store(2)
	tg := serveOn(ln, Config{Timeout: 5 * time.Second, Regions: memory.New(nil), Faults: fault.Config{Mode: fault.None},
		Tokens: func(tok []byte) (string, []byte, bool) { return "sender", key, bytes.Equal(tok, token) }})
	defer tg.close()
	cfg := &Config{Timeout: 5 * time.Second, Regions: memory.New(nil)}
	c, err := dial(context.Background(), tg.addr(), transport.Peer{Token: token, Key: key}, newPeerTable(nil), 0, cfg, 0)
	require.NoError(t, err, "the third connection is served")
	c.Close()
	require.Less(t, ln.shut.Load(), int32(0))

	ln.shut.Store(maxDialTries)
	_, err = dial(context.Background(), tg.addr(), transport.Peer{Token: token, Key: key}, newPeerTable(nil), 0, cfg, 0)
	require.ErrorIs(t, err, errShutBeforeHello, "tries run out")

	_, err = dial(context.Background(), tg.addr(), transport.Peer{Token: []byte("0123456789abcdef"), Key: key}, newPeerTable(nil), 0, cfg, 0)
	require.Error(t, err)
	require.NotErrorIs(t, err, errShutBeforeHello, "a refusal is final")
}
