package tcp

import (
	"io"
	"net"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/core/fault"
	"github.com/mcguard/mcguard/core/memory"
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
	c, err := net.DialTimeout("tcp", tg.addr(), time.Second)
	require.NoError(t, err)
	defer c.Close()
	// The challenge, then a hello with a bad token: answers prove the
	// connection is served.
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	hdr := make([]byte, wire.HeaderSize)
	_, err = io.ReadFull(c, append(hdr, make([]byte, wire.ChallengeSize)...))
	require.NoError(t, err, "the target accepted after the errors")
	wire.Header{Op: wire.OpHello, ID: 1, Len: wire.HelloSize}.Encode(hdr)
	_, err = c.Write(append(hdr, make([]byte, wire.HelloSize)...))
	require.NoError(t, err)
	_, err = io.ReadFull(c, hdr)
	require.NoError(t, err)
	h, err := wire.Decode(hdr)
	require.NoError(t, err)
	require.Equal(t, wire.StatusUnauthorized, h.Status)
	require.Less(t, flaky.fails.Load(), int32(0), "every injected error was met")
}

func TestProveRefusalsSayWhy(t *testing.T) {
	require.Contains(t, errnoText(0), "did not match")
	require.Contains(t, errnoText(wire.ProveNoGrant), "no same-host grant")
	require.Contains(t, errnoText(uint64(syscall.EPERM)), "operation not permitted")
}
