package core

import (
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"io"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	zmq "github.com/pebbe/zmq4"
	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/core/control"
	"github.com/mcguard/mcguard/core/wire"
)

// rawRequest sends one frame on c and reads its reply header (dropping a
// read-back's bytes, the only reply with a payload).
func rawRequest(t *testing.T, c net.Conn, h wire.Header, payload []byte) wire.Header {
	t.Helper()
	h.Len = uint64(len(payload))
	_, err := c.Write(frame(h, payload))
	require.NoError(t, err)
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	b := make([]byte, wire.HeaderSize)
	_, err = io.ReadFull(c, b)
	require.NoError(t, err)
	rep, err := wire.Decode(b)
	require.NoError(t, err)
	if rep.Op == wire.OpRead|wire.Reply {
		_, err = io.CopyN(io.Discard, c, int64(rep.Len))
		require.NoError(t, err)
	}
	return rep
}

// A peer that names the receiver's own process in its same-host offer,
// writes the handshake's nonce into registered memory and proves itself
// at that address, must not then have the receiver copy its own
// unregistered memory into a region the peer can read back: the target
// reads only a process the kernel named on its identity socket.
func TestSameHostOfferCannotNameAnotherProcess(t *testing.T) {
	const size = 64 << 10
	secret := newMem(t, 4096) // never registered
	fill(secret.b)
	landing := newMem(t, size)
	recv := openGuard(t, `{"timeout_ms": 1000, "same_host_writer": "receiver"}`)
	require.NoError(t, recv.Register(landing.addr(0), size))

	boot, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	require.NoError(t, err)
	ns, err := os.Readlink("/proc/self/ns/pid")
	require.NoError(t, err)
	offer, _ := json.Marshal(map[string]any{"boot": strings.TrimSpace(string(boot)), "pidns": ns, "pid": os.Getpid()})
	zctx, err := zmq.NewContext()
	require.NoError(t, err)
	defer zctx.Term()
	hello, err := control.Handshake(t.Context(), zctx, recv.Endpoint(), time.Second, nil, control.Hello{Transport: "tcp", Sender: []byte("mallory"), Offer: offer})
	require.NoError(t, err)
	var a struct {
		SameHost string `json:"same_host"`
	}
	require.NoError(t, json.Unmarshal(hello.Answer, &a))
	require.NotEmpty(t, a.SameHost, "the receiver offers a same-host grant to a same-host offer")
	nonce, err := hex.DecodeString(a.SameHost)
	require.NoError(t, err)

	c, err := net.Dial("tcp", dataAddr(recv))
	require.NoError(t, err)
	defer c.Close()
	challenge, err := readChallenge(c)
	require.NoError(t, err)
	require.NoError(t, bindData(c, hello, challenge))
	// The nonce, written into registered memory: in the receiver's process.
	rep := rawRequest(t, c, wire.Header{Op: wire.OpWrite, ID: 2, Addr: landing.addr(0)}, nonce)
	require.Equal(t, wire.StatusOK, rep.Status)
	rep = rawRequest(t, c, wire.Header{Op: wire.OpProve, ID: 3, Addr: landing.addr(0)}, nil)
	require.Equal(t, wire.StatusNoAccess, rep.Status, "a grant whose process no kernel proved lets no connection prove itself")
	require.Equal(t, uint64(wire.ProveNoIdentity), rep.Len)
	// And the copy out of "the sender" is refused.
	ref := binary.LittleEndian.AppendUint64(binary.LittleEndian.AppendUint64(nil, secret.addr(0)), 4096)
	rep = rawRequest(t, c, wire.Header{Op: wire.OpWriteFrom, ID: 4, Addr: landing.addr(4096)}, ref)
	require.NotEqual(t, wire.StatusOK, rep.Status)
	require.False(t, bytes.Equal(landing.b[4096:8192], secret.b), "no byte of the receiver's unregistered memory reached registered memory")
}
