package core

import (
	"bytes"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	zmq "github.com/pebbe/zmq4"
	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/core/auth"
	"github.com/mcguard/mcguard/core/control"
	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/core/wire"
)

// othersShakeHands makes n handshakes at g from as many other senders.
func othersShakeHands(t *testing.T, g *Guard, n int) {
	t.Helper()
	zctx, err := zmq.NewContext()
	require.NoError(t, err)
	defer zctx.Term()
	for i := 0; i < n; i++ {
		_, err := control.Handshake(t.Context(), zctx, g.Endpoint(), time.Second, nil, control.Hello{Sender: auth.RandomBytes(auth.NonceSize), Transport: "tcp"})
		require.NoError(t, err)
	}
}

// digestRound transfers the pair's blocks in digest mode and syncs them at
// the receiver, which checks the notice and the digests.
func digestRound(t *testing.T, p *pair) {
	t.Helper()
	fill(p.src.b)
	res, err := p.send.Transfer(p.recv.Endpoint(), p.blocks(16, 4096), TransferOptions{})
	require.NoError(t, err)
	require.NoError(t, p.recv.SyncTransfers([]uint64{res.ID}, 0))
	require.True(t, bytes.Equal(p.src.b, p.dst.b))
}

// Another peer's handshakes never evict a live session's credentials: the
// landed version refused its notices after 4096 of them.
func TestLongLivedSessionOutlivesOtherSendersHandshakes(t *testing.T) {
	p := newPair(t, `{"verify": "digest"}`, "", 16*4096)
	digestRound(t, p)
	othersShakeHands(t, p.recv, 4200)
	digestRound(t, p)
}

// A session whose handshake the receiver forgot all the same (crowded out
// while idle) shakes hands again, once, and goes on; the receiver's table
// stays within its bound.
func TestForgottenSessionShakesHandsAgain(t *testing.T) {
	old := auth.MaxSenders
	auth.MaxSenders = 8
	t.Cleanup(func() { auth.MaxSenders = old })
	p := newPair(t, `{"verify": "digest"}`, "", 16*4096)
	digestRound(t, p)
	othersShakeHands(t, p.recv, 50)
	digestRound(t, p)
	senders, tokens := p.recv.auth.Tokens.Size()
	require.LessOrEqual(t, senders, 8)
	require.LessOrEqual(t, tokens, 8*auth.TokensPerSender)
}

// A sender's refreshes keep at most auth.TokensPerSender tokens at the receiver.
func TestRefreshesAreBoundedPerSender(t *testing.T) {
	g := openGuard(t, "")
	zctx, err := zmq.NewContext()
	require.NoError(t, err)
	defer zctx.Term()
	sender := auth.RandomBytes(auth.NonceSize)
	for i := 0; i < 100; i++ {
		_, err := control.Handshake(t.Context(), zctx, g.Endpoint(), time.Second, nil, control.Hello{Sender: sender, Transport: "tcp"})
		require.NoError(t, err)
	}
	senders, tokens := g.auth.Tokens.Size()
	require.Equal(t, 1, senders)
	require.Equal(t, auth.TokensPerSender, tokens)
}

// A peer that sends a write's header and stalls in its payload holds up
// nobody else: not registration, not other peers' transfers, and
// unregistering the region it writes into cuts it off at once. The landed
// version held the region table's lock across the read (4.8 s measured).
func TestStalledPeerHoldsUpNobody(t *testing.T) {
	p := newPair(t, "", `{"timeout_ms": 5000}`, 16*4096)
	stalled := newMem(t, 1<<20)
	require.NoError(t, p.recv.Register(stalled.addr(0), 1<<20))
	c := dataConn(t, p.recv, shakeHands(t, p.recv, auth.RandomBytes(auth.NonceSize)))
	defer c.Close()
	c.Write(frame(wire.Header{Op: wire.OpWrite, ID: 2, Addr: stalled.addr(0), Len: 512 << 10}, make([]byte, 1000)))
	time.Sleep(100 * time.Millisecond) // the target is now inside the payload

	start := time.Now()
	other := newMem(t, 4096)
	require.NoError(t, p.recv.Register(other.addr(0), 4096))
	require.NoError(t, p.recv.Unregister(other.addr(0)))
	fill(p.src.b)
	_, err := p.send.Transfer(p.recv.Endpoint(), p.blocks(16, 4096), TransferOptions{})
	require.NoError(t, err)
	require.True(t, bytes.Equal(p.src.b, p.dst.b))
	require.Less(t, time.Since(start), time.Second, "registration and another peer's transfer went on")

	start = time.Now()
	require.NoError(t, p.recv.Unregister(stalled.addr(0)))
	require.Less(t, time.Since(start), time.Second, "unregistering cut the stalled write off")
	c.SetReadDeadline(time.Now().Add(2 * time.Second))
	_, err = c.Read(make([]byte, 64))
	require.Error(t, err, "the stalled peer's connection was closed")
	for i := range stalled.b {
		stalled.b[i] = 0xAB // the application reuses the memory
	}
	c.Write(make([]byte, 512<<10)) // the rest of the payload, too late
	time.Sleep(50 * time.Millisecond)
	require.Equal(t, bytes.Repeat([]byte{0xAB}, 1<<20), stalled.b, "nothing lands after Unregister returned")
}

// A guard listens on IPv4 and IPv6 addresses and host names, and sessions
// name it in the same forms (the landed version failed "[::1]:0" and
// "localhost:0" with "no such device").
func TestListenAndSessionsOnIPv6AndNames(t *testing.T) {
	cases := []struct{ listen, session string }{
		{"[::1]:0", ""},
		{"localhost:0", ""},
		{"127.0.0.1:0", "localhost"},
		{"[::]:0", "[::1]"},
		{"[::]:0", "127.0.0.1"},
	}
	for _, tc := range cases {
		t.Run(tc.listen+"/"+tc.session, func(t *testing.T) {
			recvJS := fmt.Sprintf(`{"listen": %q, "allow_insecure": true}`, tc.listen)
			p := newPair(t, "", recvJS, 16*4096)
			session := p.recv.Endpoint()
			if tc.session != "" {
				_, port, err := net.SplitHostPort(session)
				require.NoError(t, err)
				session = net.JoinHostPort(strings.Trim(tc.session, "[]"), port)
			}
			fill(p.src.b)
			_, err := p.send.Transfer(session, p.blocks(16, 4096), TransferOptions{})
			require.NoError(t, err)
			require.True(t, bytes.Equal(p.src.b, p.dst.b))
		})
	}
	_, err := LoadConfig(nil, `{"listen": "127.0.0.1:99999"}`)
	require.ErrorIs(t, err, errs.Config)
}

// Where the fence is final (the TCP target applies in order and answers
// the fence after), a mismatch is re-sent at once: the landed version
// polled max_retries x retry_sleep per chunk first (308 s against 5 s).
func TestLostWritesAreResentWithoutPolling(t *testing.T) {
	p := newPair(t, `{"on_mismatch": "resend", "max_resends": 20, "max_retries": 500, "retry_sleep_s": 0.01}`,
		`{"inject": "drop", "inject_rate": 0.3, "inject_seed": 5}`, 32*4096)
	start := time.Now()
	resends := 0
	for i := 0; i < 10; i++ {
		fill(p.src.b)
		res, err := p.send.Transfer(p.recv.Endpoint(), p.blocks(32, 4096), TransferOptions{})
		require.NoError(t, err)
		require.Zero(t, res.Retries, "no polling after a final fence")
		require.True(t, bytes.Equal(p.src.b, p.dst.b))
		resends += res.Resends
	}
	require.Positive(t, resends, "drops happened and were re-sent")
	require.Less(t, time.Since(start), 3*time.Second)
}
