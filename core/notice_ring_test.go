package core

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/core/errs"
)

func ringed(t *testing.T, g *Guard) int64 {
	return int64(stats(t, g)["same_host_ringed_notices"].(float64))
}

// A same-host sender that writes into the receiver itself leaves its
// digest notices in its connection's ring; a receiver that syncs late
// finds more than a ring holds, the rest sent on the socket behind the
// ring's (and taken after them, in order: no sequence number is refused
// as a replay), and each sync compares the landed bytes.
func TestSameHostNoticesThroughTheRingStayInOrder(t *testing.T) {
	const size, n = 4096, 600
	p := newPair(t, `{"verify": "digest"}`, "", 64*size)
	fill(p.src.b)
	ids := make([]uint64, 0, n)
	for i := 0; i < n; i++ {
		res, err := p.send.Transfer(p.session, p.blocks(64, size)[i%64:i%64+1], TransferOptions{})
		require.NoError(t, err)
		ids = append(ids, res.ID)
	}
	require.Greater(t, ringed(t, p.send), int64(0), "notices went through the ring")
	require.Less(t, ringed(t, p.send), int64(n), "a full ring sends the rest on the socket")
	require.NoError(t, p.recv.SyncTransfers(ids, 0), "every notice taken, in order, every digest matched")
	require.Equal(t, int64(n), int64(stats(t, p.recv)["notices_received"].(float64)))

	res, err := p.send.Transfer(p.session, p.blocks(1, size), TransferOptions{})
	require.NoError(t, err)
	p.dst.b[100] ^= 1 // something else wrote there before the sync
	require.ErrorIs(t, p.recv.SyncTransfers([]uint64{res.ID}, 0), errs.Verify)
}

// The ring's notices are taken when the connection ends, not lost with
// it: the sync comes after the receiver let the connection go, when no
// ring is left to look in.
func TestSameHostRingNoticesOutliveTheConnection(t *testing.T) {
	p := newPair(t, `{"verify": "digest"}`, "", 4*4096)
	fill(p.src.b)
	res, err := p.send.Transfer(p.session, p.blocks(4, 4096), TransferOptions{})
	require.NoError(t, err)
	require.Equal(t, int64(1), ringed(t, p.send))
	require.EqualValues(t, 1, stats(t, p.recv)["same_host_writers"])
	require.EqualValues(t, 0, stats(t, p.recv)["notices_received"], "the notice is still in the ring")
	p.send.Close()
	require.Eventually(t, func() bool { return stats(t, p.recv)["same_host_writers"].(float64) == 0 },
		5*time.Second, time.Millisecond, "the receiver let the connection and its slot go")
	require.EqualValues(t, 1, stats(t, p.recv)["notices_received"], "taken as the connection ended")
	require.NoError(t, p.recv.SyncTransfers([]uint64{res.ID}, 0))
}
