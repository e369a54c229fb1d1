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
// sender's table is older, and its write across the new boundary is
// refused. The sender shakes hands again, learns the two regions and
// writes the chunk once more, so the transfer succeeds; in digest mode,
// whose notice may already be out, it fails instead, naming the
// descriptors written as one, and the next transfer goes through.
func TestJoinedWritesAfterTheReceiverRegisteredAgain(t *testing.T) {
	for _, mode := range []verify.Mode{verify.Off, verify.Tail, verify.Sample, verify.Digest} {
		t.Run(string(mode), func(t *testing.T) {
			p := newPair(t, `{"same_host": "off"}`, "", 8192)
			descs := p.blocks(2, 4096)
			transfer := func() error {
				res, err := p.send.Transfer(p.session, descs, TransferOptions{Verify: &mode})
				if err == nil && mode == verify.Digest {
					err = p.recv.SyncTransfers([]uint64{res.ID}, 0)
				}
				return err
			}
			require.NoError(t, transfer())
			require.NoError(t, p.recv.Unregister(p.dst.addr(0)))
			require.NoError(t, p.recv.Register(p.dst.addr(0), 4096))
			require.NoError(t, p.recv.Register(p.dst.addr(4096), 4096))

			rand.Read(p.src.b)
			err := transfer()
			if mode == verify.Digest {
				require.ErrorIs(t, err, ErrNotRegistered)
				require.Contains(t, err.Error(), "descriptors 0 to 1 (written as one)")
				err = transfer()
			}
			require.NoError(t, err)
			require.Equal(t, p.src.b, p.dst.b)
		})
	}
}
