package core

import (
	"fmt"
	"testing"
	"time"

	zmq "github.com/pebbe/zmq4"
	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/core/auth"
	"github.com/mcguard/mcguard/core/control"
	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/core/notices"
	"github.com/mcguard/mcguard/core/transport"
	"github.com/mcguard/mcguard/core/wire"
)

// On one host a digest transfer returns without waiting for its notice's
// answer; a refusal surfaces at a later call of the session once the
// receiver made it, which fails naming the earlier transfer, counts it, and sends
// nothing. The calls after it go on.
func TestRefusedNoticeSurfacesAtALaterCall(t *testing.T) {
	for _, plane := range []string{"required", "off"} {
		t.Run("same_host "+plane, func(t *testing.T) {
			p := newPair(t, `{"verify": "digest", "same_host": "`+plane+`"}`, "", 4*4096)
			fill(p.src.b)
			first, err := p.send.Transfer(p.session, p.blocks(1, 4096), TransferOptions{})
			require.NoError(t, err)
			// The next transfer reuses the first's id: the receiver, which
			// holds the first's notice unsynced, refuses the second's.
			p.send.ids.next.Add(^uint64(0)) // one back
			second, err := p.send.Transfer(p.session, p.blocks(1, 4096), TransferOptions{})
			if plane == "off" {
				// Over the socket the fence reads the notice's answer in the call.
				require.ErrorIs(t, err, errs.Session)
				require.Contains(t, err.Error(), "refused the completion notice")
				return
			}
			require.NoError(t, err, "the same-host call returns before the answer")
			require.Equal(t, first.ID, second.ID)
			// A later call reads the refusal once the receiver took the
			// notice: from the connection's ring when something else makes
			// it look (here: the ring fills, and the next notice goes on
			// the socket behind its notices).
			synced := []uint64{first.ID}
			for i := 0; ; i++ {
				require.Less(t, i, 2000, "the refusal never surfaced")
				res, err := p.send.Transfer(p.session, p.blocks(1, 4096), TransferOptions{})
				if err != nil {
					require.Contains(t, err.Error(), "earlier transfer's completion notice")
					require.Contains(t, err.Error(), fmt.Sprintf("refused the completion notice of transfer %#x", first.ID))
					break
				}
				synced = append(synced, res.ID)
				time.Sleep(time.Millisecond)
			}
			require.EqualValues(t, 1, stats(t, p.send)["notices_undelivered"])
			third, err := p.send.Transfer(p.session, p.blocks(1, 4096), TransferOptions{})
			require.NoError(t, err, "the session goes on")
			require.NoError(t, p.recv.SyncTransfers(append(synced, third.ID), 0))
		})
	}
}

// A notice on a data connection, under the handshake that connection
// proved, is taken after the guard's table forgot the handshake; a replay
// of it is not, nor the same notice from the control channel or another
// connection.
func TestNoticeOnItsConnectionOutlivesTheTable(t *testing.T) {
	old := auth.MaxSenders
	auth.MaxSenders = 2
	t.Cleanup(func() { auth.MaxSenders = old })
	g := openGuard(t, "")
	dst := newMem(t, 4096)
	require.NoError(t, g.Register(dst.addr(0), 4096))
	zctx, err := zmq.NewContext()
	require.NoError(t, err)
	defer zctx.Term()
	sender := auth.RandomBytes(auth.NonceSize)
	rep, err := control.Handshake(t.Context(), zctx, g.Endpoint(), time.Second, nil, control.Hello{Sender: sender, Transport: "tcp"})
	require.NoError(t, err)
	s := &session{hello: rep}
	sign := func() []byte {
		n := wire.Notice{ID: uint64(time.Now().UnixNano()), Total: 1, Descs: []wire.NoticeDesc{{Dst: dst.addr(0), Len: 4096}}}
		return append([]byte(nil), s.signNotice(n)...)
	}
	conn := &transport.ConnAuth{Token: rep.Token, Key: rep.Key, Sender: string(sender)}
	require.NoError(t, g.takeNotice(sign(), nil, conn), "known to the table")

	othersShakeHands(t, g, 4) // crowds this sender out
	body := sign()
	require.ErrorIs(t, g.takeNotice(body, nil, nil), auth.ErrUnknownNoticeToken, "the control channel has only the table")
	other := &transport.ConnAuth{Token: auth.RandomBytes(wire.TokenSize), Key: rep.Key}
	require.ErrorIs(t, g.takeNotice(body, nil, other), auth.ErrUnknownNoticeToken, "another connection's handshake")
	require.NoError(t, g.takeNotice(body, nil, conn), "its own connection's")
	require.ErrorContains(t, g.takeNotice(body, nil, conn), "replay")
	forged := sign()
	forged[len(forged)-1] ^= 1 // a descriptor's digest: the MAC no longer holds
	require.ErrorContains(t, g.takeNotice(forged, nil, conn), "MAC")
	require.NoError(t, g.takeNotice(sign(), nil, conn))
	// The table's and the connection's notices count as one sender's.
	require.Equal(t, map[string]notices.Load{string(sender): {Entries: 3, Descs: 3}}, g.notices.Loads())
}
