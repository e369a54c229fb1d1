package core

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/core/desc"
	"github.com/mcguard/mcguard/core/notices"
)

// Over TCP, each sending guard's notices count as its own, through the
// handshake its data connection proved, and syncing them forgets it.
func TestNoticesCountPerSendingGuard(t *testing.T) {
	const js = `{"verify": "digest", "same_host": "off"}`
	p := newPair(t, js, "", 8*4096)
	other := openGuard(t, js)
	src := newMem(t, 4096)
	require.NoError(t, other.Register(src.addr(0), 4096))
	var ids []uint64
	for i := 0; i < 3; i++ {
		res, err := p.send.Transfer(p.session, p.blocks(1, 4096), TransferOptions{})
		require.NoError(t, err)
		ids = append(ids, res.ID)
		res, err = other.Transfer(p.session, []desc.Desc{{Src: src.addr(0), Dst: p.dst.addr(4096 * (1 + i)), Len: 4096}}, TransferOptions{})
		require.NoError(t, err)
		ids = append(ids, res.ID)
	}
	loads := p.recv.notices.Loads()
	require.Len(t, loads, 2)
	for sender, load := range loads {
		require.Equal(t, notices.Load{Entries: 3, Descs: 3}, load, sender)
	}
	require.NoError(t, p.recv.SyncTransfers(ids, 0))
	require.Empty(t, p.recv.notices.Loads())
}
