package core

import (
	"bytes"
	"testing"
	"time"

	zmq "github.com/pebbe/zmq4"
	"github.com/stretchr/testify/require"
)

// othersShakeHands makes n handshakes at g from as many other senders.
func othersShakeHands(t *testing.T, g *Guard, n int) {
	t.Helper()
	zctx, err := zmq.NewContext()
	require.NoError(t, err)
	defer zctx.Term()
	for i := 0; i < n; i++ {
		_, err := handshake(t.Context(), zctx, g.Endpoint(), time.Second, nil, helloRequest{Sender: randomBytes(nonceSize), Transport: "tcp"})
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
	old := maxSenders
	maxSenders = 8
	t.Cleanup(func() { maxSenders = old })
	p := newPair(t, `{"verify": "digest"}`, "", 16*4096)
	digestRound(t, p)
	othersShakeHands(t, p.recv, 50)
	digestRound(t, p)
	senders, tokens := p.recv.auth.tokens.size()
	require.LessOrEqual(t, senders, 8)
	require.LessOrEqual(t, tokens, 8*tokensPerSender)
}

// A sender's refreshes keep at most tokensPerSender tokens at the receiver.
func TestRefreshesAreBoundedPerSender(t *testing.T) {
	g := openGuard(t, "")
	zctx, err := zmq.NewContext()
	require.NoError(t, err)
	defer zctx.Term()
	sender := randomBytes(nonceSize)
	for i := 0; i < 100; i++ {
		_, err := handshake(t.Context(), zctx, g.Endpoint(), time.Second, nil, helloRequest{Sender: sender, Transport: "tcp"})
		require.NoError(t, err)
	}
	senders, tokens := g.auth.tokens.size()
	require.Equal(t, 1, senders)
	require.Equal(t, tokensPerSender, tokens)
}
