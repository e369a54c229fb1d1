package core

import (
	"crypto/rand"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/verify"
)

// Consecutive blocks go over the socket as one write per run (inside one
// registered region at each end, tcp/join_test.go), and stats count the
// descriptors joined: every mode delivers them, the same host's copies
// too (written by the sender itself there, one copy each, none joined).
func TestConsecutiveBlocksInEveryMode(t *testing.T) {
	for _, plane := range []string{`"same_host": "off"`, `"same_host": "required"`} {
		p := newPair(t, `{`+plane+`}`, "", 256<<10)
		for i, mode := range verify.Modes {
			rand.Read(p.src.b)
			descs := p.blocks(64, 4096)
			res, err := p.send.Transfer(p.session, descs, TransferOptions{Verify: &mode})
			require.NoError(t, err, "%s %s", plane, mode)
			if mode == verify.Digest {
				require.NoError(t, p.recv.SyncTransfers([]uint64{res.ID}, 0))
			}
			require.Equal(t, p.src.b, p.dst.b, "%s %s", plane, mode)
			if plane == `"same_host": "off"` {
				require.EqualValues(t, 63*(i+1), stats(t, p.send)["joined_descriptors"], "64 blocks, one write")
			}
		}
		// Backwards: nothing continues, nothing is joined.
		before := stats(t, p.send)["joined_descriptors"]
		descs := p.blocks(64, 4096)
		for i, j := 0, len(descs)-1; i < j; i, j = i+1, j-1 {
			descs[i].Dst, descs[j].Dst = descs[j].Dst, descs[i].Dst
		}
		_, err := p.send.Transfer(p.session, descs, TransferOptions{})
		require.NoError(t, err)
		require.Equal(t, before, stats(t, p.send)["joined_descriptors"])
	}
}

// A receiver that cut a region in two after the sender's handshake: the
// sender's table is older, its write across the new boundary is refused,
// and the transfer fails naming the descriptors written as one. The
// failure drops the connection; the next transfer shakes hands again,
// learns the two regions, and goes through.
func TestJoinedWritesAfterTheReceiverRegisteredAgain(t *testing.T) {
	p := newPair(t, `{"verify": "tail", "same_host": "off"}`, "", 8192)
	descs := p.blocks(2, 4096)
	_, err := p.send.Transfer(p.session, descs, TransferOptions{})
	require.NoError(t, err)
	require.NoError(t, p.recv.Unregister(p.dst.addr(0)))
	require.NoError(t, p.recv.Register(p.dst.addr(0), 4096))
	require.NoError(t, p.recv.Register(p.dst.addr(4096), 4096))

	rand.Read(p.src.b)
	_, err = p.send.Transfer(p.session, descs, TransferOptions{})
	require.ErrorIs(t, err, ErrNotRegistered)
	require.Contains(t, err.Error(), "descriptors 0 to 1 (written as one)")
	_, err = p.send.Transfer(p.session, descs, TransferOptions{})
	require.NoError(t, err)
	require.Equal(t, p.src.b, p.dst.b)
}
