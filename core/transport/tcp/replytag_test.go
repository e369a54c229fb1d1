package tcp

import (
	"bytes"
	"context"
	"crypto/rand"
	"io"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/core/desc"
	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/core/fault"
	"github.com/mcguard/mcguard/core/internal/testmem"
	"github.com/mcguard/mcguard/core/memory"
	"github.com/mcguard/mcguard/core/transport"
	"github.com/mcguard/mcguard/core/wire"
)

// tamperer is an attacker on the path of one data connection: it flips
// the last byte of every write on its way to the target, and the last
// byte of every read-back answer on its way back, so that a read-back of
// a write's tail finds the bytes the sender wrote while the target holds
// others.
type tamperer struct {
	ln     net.Listener
	target string
	tags   bool // replies the verification rests on carry a tag (to skip it)
	fence  bool // also alter the fence's reply (a field the sender ignores)
}

func (p *tamperer) serve(t *testing.T) {
	c, err := p.ln.Accept()
	if err != nil {
		return
	}
	defer c.Close()
	up, err := net.Dial("tcp", p.target)
	require.NoError(t, err)
	defer up.Close()
	go p.pipe(up, c, false)
	p.pipe(c, up, true)
}

// pipe copies frames from src to dst, tampering with write payloads
// (toTarget) or read-back answers.
func (p *tamperer) pipe(src, dst net.Conn, toTarget bool) {
	defer dst.Close()
	hdr := make([]byte, wire.HeaderSize)
	for {
		if _, err := io.ReadFull(src, hdr); err != nil {
			return
		}
		h, err := wire.Decode(hdr)
		if err != nil {
			return
		}
		n := h.Len
		if !toTarget && h.Op != wire.OpChallenge && h.Op != wire.OpRead|wire.Reply {
			n = 0 // only a challenge and a read-back answer carry bytes
		}
		body := make([]byte, n)
		if _, err := io.ReadFull(src, body); err != nil {
			return
		}
		if n > 0 && (toTarget && h.Op == wire.OpWrite || !toTarget && h.Op == wire.OpRead|wire.Reply) {
			body[n-1] ^= 0xFF
		}
		if !toTarget && p.fence && h.Op == wire.OpFence|wire.Reply {
			hdr[16] ^= 1 // its Addr: nothing reads it, but it is not what the target sent
		}
		if !toTarget && p.tags && tagged(h.Op&^wire.Reply) {
			tag := make([]byte, tagSize)
			if _, err := io.ReadFull(src, tag); err != nil {
				return
			}
			body = append(body, tag...)
		}
		if _, err := dst.Write(append(append([]byte(nil), hdr...), body...)); err != nil {
			return
		}
	}
}

// A tail check through an attacker who alters a write and, on the way
// back, the read-back's answer to match: without authenticated replies it
// passes over wrong bytes at the target; with them (the guards share a
// secret) the forged answer fails its tag and the read-back fails.
func TestForgedReadBackAnswersFailTheirTag(t *testing.T) {
	for _, tags := range []bool{false, true} {
		src, dst := testmem.Pages(t, 1), testmem.Pages(t, 1)
		rand.Read(src)
		tg, peer := taggedTarget(t, dst, tags)
		p := &tamperer{ln: mustListen(t), target: tg.addr(), tags: tags}
		go p.serve(t)
		defer p.ln.Close()
		local := memory.New(nil)
		require.NoError(t, local.Add(memory.AddrOf(src), uint64(len(src))))
		c, err := dial(context.Background(), p.ln.Addr().String(), peer, newPeerTable(tg.regions.Snapshot()), 0,
			&Config{Timeout: 5 * time.Second, Regions: local, MACReplies: tags}, 0)
		require.NoError(t, err)
		ctx := context.Background()
		require.NoError(t, c.Post(ctx, []desc.Desc{{Src: memory.AddrOf(src), Dst: memory.AddrOf(dst), Len: 4096}}, 0))
		tail := make([]byte, 64)
		err = c.Read(ctx, []desc.Range{{Addr: memory.AddrOf(dst) + 4096 - 64, Len: 64}}, tail, true)
		require.NotEqual(t, src, dst, "the target holds altered bytes")
		if tags {
			require.ErrorIs(t, err, errs.Peer, "the forged answer fails its tag")
			require.Contains(t, err.Error(), "does not carry this connection's tag")
		} else {
			require.NoError(t, err)
			require.Equal(t, src[4096-64:], tail, "without tags the forged answer matches the source: a tail check passes")
		}
		c.Close()
	}
}

// taggedTarget serves dst (registered) with its replies tagged or not,
// and is the peer whose token and key its hello takes.
func taggedTarget(t *testing.T, dst []byte, tags bool) (*target, transport.Peer) {
	regions := memory.New(nil)
	require.NoError(t, regions.Add(memory.AddrOf(dst), uint64(len(dst))))
	token, key := make([]byte, wire.TokenSize), []byte("the handshake's key")
	tg := serveOn(mustListen(t), Config{Timeout: 5 * time.Second, Regions: regions, Faults: fault.Config{Mode: fault.None}, MACReplies: tags,
		Tokens: func(tok []byte) (string, []byte, bool) { return "sender", key, bytes.Equal(tok, token) }})
	t.Cleanup(tg.close)
	return tg, transport.Peer{Token: token, Key: key}
}

// Any reply verification rests on is the target's or fails: a fence
// reply altered on the way (in a field the sender ignores) fails its tag.
func TestAlteredFenceRepliesFailTheirTag(t *testing.T) {
	dst := testmem.Pages(t, 1)
	tg, peer := taggedTarget(t, dst, true)
	p := &tamperer{ln: mustListen(t), target: tg.addr(), tags: true, fence: true}
	defer p.ln.Close()
	go p.serve(t)
	c, err := dial(context.Background(), p.ln.Addr().String(), peer, newPeerTable(tg.regions.Snapshot()), 0,
		&Config{Timeout: 5 * time.Second, Regions: memory.New(nil), MACReplies: true}, 0)
	require.NoError(t, err)
	defer c.Close()
	err = c.Read(context.Background(), []desc.Range{{Addr: memory.AddrOf(dst), Len: 64}}, make([]byte, 64), true)
	require.ErrorIs(t, err, errs.Peer)
	require.Contains(t, err.Error(), "the reply to a fence does not carry this connection's tag")
}
