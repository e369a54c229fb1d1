package core

import (
	"bytes"
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/core/desc"
	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/verify"
)

// forgeNotice sends, from g's session to the guard at session, a digest
// mode notice for transfer id claiming that chunk's destinations hold
// bytes with these digests, and returns the receiver's answer.
func forgeNotice(t *testing.T, g *Guard, session string, id uint64, chunk []desc.Desc, digests []uint64) error {
	ctx := context.Background()
	s, err := g.lockSession(ctx, session, chunk)
	require.NoError(t, err)
	defer s.mu.Unlock()
	if err := g.notify(ctx, s, id, verify.Digest, len(chunk), 0, chunk, digests, true); err != nil {
		return err
	}
	// A fenced read-back of one byte reads the notice's answer first.
	err = s.conn.Read(ctx, []desc.Range{{Addr: chunk[0].Dst, Len: 1}}, make([]byte, 1), true)
	s.disconnect()
	return err
}

// A peer with a token cannot have the receiver's sync of another sender's
// transfer succeed on a notice of its own: it cannot tell the id the
// sender's next transfer will have (a counter's it could, and its notice,
// with digests of what the receiver's memory already held, was synced as
// that transfer); and where it learns an id before the receiver synced
// it, the sync fails instead of choosing.
func TestANoticeCannotStandInForAnotherSenders(t *testing.T) {
	const size = 4096
	p := newPair(t, `{"verify": "digest", "same_host": "off"}`, "", size)
	mallory := openGuard(t, `{"same_host": "off"}`)
	chunk := p.blocks(1, size)

	fill(p.src.b)
	first, err := p.send.Transfer(p.session, chunk, TransferOptions{})
	require.NoError(t, err)
	require.NoError(t, p.recv.SyncTransfers([]uint64{first.ID}, 0))

	// Mallory's guess at the sender's next id, with the digest of what the
	// destination holds now: the receiver takes it (it is her own id).
	guess := first.ID + 1
	now := []uint64{desc.DigestOf(p.dst.b)}
	require.NoError(t, forgeNotice(t, mallory, p.session, guess, chunk, now))

	fill(p.src.b)
	second, err := p.send.Transfer(p.session, chunk, TransferOptions{})
	require.NoError(t, err)
	require.NotEqual(t, guess, second.ID, "the sender's next id is not the one a counter gives")
	require.NoError(t, p.recv.SyncTransfers([]uint64{second.ID}, 0))
	require.True(t, bytes.Equal(p.src.b, p.dst.b))

	// An id Mallory saw (on the path) before the receiver synced it.
	fill(p.src.b)
	third, err := p.send.Transfer(p.session, chunk, TransferOptions{})
	require.NoError(t, err)
	require.Error(t, forgeNotice(t, mallory, p.session, third.ID, chunk, now), "the receiver refuses her notice")
	err = p.recv.SyncTransfers([]uint64{third.ID}, 0)
	require.ErrorIs(t, err, errs.Session)
	require.Contains(t, err.Error(), "two senders")
}
