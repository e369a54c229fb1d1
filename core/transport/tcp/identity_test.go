package tcp

import (
	"bytes"
	"context"
	"crypto/rand"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/core/cuda"
	"github.com/mcguard/mcguard/core/desc"
	"github.com/mcguard/mcguard/core/fault"
	"github.com/mcguard/mcguard/core/internal/testmem"
	"github.com/mcguard/mcguard/core/memory"
	"github.com/mcguard/mcguard/core/transport"
	"github.com/mcguard/mcguard/core/transport/samehost"
	"github.com/mcguard/mcguard/core/wire"
)

// sameHostTransport is a receiving Transport whose tokens all belong to
// "sender", with dst registered, and the peer a sender presents to it.
func sameHostTransport(t *testing.T, dst []byte) (*Transport, transport.Peer) {
	token, key := make([]byte, wire.TokenSize), []byte("key")
	rand.Read(token)
	regions := memory.New(nil)
	require.NoError(t, regions.Add(memory.AddrOf(dst), uint64(len(dst))))
	tr, err := New(Config{Host: "127.0.0.1", Timeout: 5 * time.Second, Regions: regions, Faults: fault.Config{Mode: fault.None},
		SameHost: samehost.Auto, SameHostWriter: samehost.WriterSender,
		Tokens: func(tok []byte) (string, []byte, bool) { return "sender", key, bytes.Equal(tok, token) }})
	require.NoError(t, err)
	t.Cleanup(tr.Close)
	require.NoError(t, tr.Register(memory.AddrOf(dst), uint64(len(dst)), cuda.Memory{}))
	return tr, transport.Peer{Sender: "sender", Token: token, Key: key}
}

// A prove reply carries any slot epoch: a receiver kept same-host for
// 10,000 connections (the epoch once shared the reply's length with the
// slot, and past 1,023 connections the reply no longer decoded), and a
// sender that requires same-host kept being served.
func TestSameHostConnectionsForTheLifeOfTheProcess(t *testing.T) {
	conns := 10000
	if testing.Short() {
		conns = 1100
	}
	src, dst := testmem.Pages(t, 1), testmem.Pages(t, 1)
	tr, peer := sameHostTransport(t, dst)
	regions := memory.New(nil)
	require.NoError(t, regions.Add(memory.AddrOf(src), uint64(len(src))))
	sender, err := New(Config{Host: "127.0.0.1", Timeout: 5 * time.Second, Regions: regions, Faults: fault.Config{Mode: fault.None},
		SameHost: samehost.Required, Tokens: func([]byte) (string, []byte, bool) { return "", nil, false }})
	require.NoError(t, err)
	defer sender.Close()
	d, err := sender.Dial()
	require.NoError(t, err)
	answer, err := tr.Accept(peer, d.(dialer).Offer(), nil)
	require.NoError(t, err)
	ctx := context.Background()
	var leased int
	for i := range conns {
		c, err := d.Connect(ctx, peer, answer, regions.Snapshot())
		require.NoError(t, err, "connection %d", i)
		cn := c.(*conn)
		require.True(t, cn.pull, "connection %d is a same-host one", i)
		if cn.lease != nil {
			leased++
		}
		if i%1000 == 0 || i == conns-1 {
			rand.Read(src)
			require.NoError(t, c.Write(ctx, []desc.Desc{{Src: memory.AddrOf(src), Dst: memory.AddrOf(dst), Len: uint64(len(src))}}, 0))
			require.Equal(t, src, dst, "connection %d delivered", i)
		}
		c.Close()
	}
	require.Greater(t, leased, conns/2, "most connections wrote into the receiver themselves")
	require.Greater(t, tr.target.lease.HandedOut(), uint64(1<<10))
}
