package core

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/core/wire"
)

// countedLanded is a landed set that counts its releases.
type countedLanded struct{ released *int }

func (c countedLanded) Digest(uint64, uint64) (uint64, int, bool)         { return 0, -1, false }
func (c countedLanded) DigestAt(int, uint64, uint64) (uint64, bool, bool) { return 0, false, false }
func (c countedLanded) Len() int                                          { return 0 }
func (c countedLanded) Release()                                          { *c.released++ }

// A receiver whose application never syncs keeps at most
// maxNoticeEntries notices: the oldest go, their landed digests released,
// their entries reused, so the flood allocates nothing once at the bound,
// and a late sync of a dropped one says what happened.
func TestNoticesPastTheBoundAreDroppedOldestFirst(t *testing.T) {
	s := newNoticeStore()
	released := 0
	add := func(id uint64) {
		n := wire.Notice{ID: id, Total: 1, Descs: []wire.NoticeDesc{{Dst: 4096, Len: 64}}}
		require.NoError(t, s.add(n, countedLanded{&released}))
	}
	const extra = 10
	for id := uint64(1); id <= maxNoticeEntries+extra; id++ {
		add(id)
	}
	require.Len(t, s.entries, maxNoticeEntries)
	require.Equal(t, extra, released, "each dropped notice released its landed digests")
	w := newNoticeWaiter()
	_, err := s.take(1, &w, time.Now().Add(time.Second), nil)
	require.ErrorIs(t, err, ErrSession)
	require.Contains(t, err.Error(), "dropped")
	e, err := s.take(extra+1, &w, time.Now().Add(time.Second), nil)
	require.NoError(t, err, "the oldest kept")
	s.release(e)

	next := uint64(maxNoticeEntries + extra + 1)
	n := wire.Notice{Total: 1, Descs: []wire.NoticeDesc{{Dst: 4096, Len: 64}}}
	landed := countedLanded{&released}
	allocs := testing.AllocsPerRun(1000, func() {
		n.ID = next
		next++
		if err := s.add(n, landed); err != nil {
			t.Fatal(err)
		}
	})
	// The arrival order's slice is amortised, as are the maps' growth;
	// an entry per notice was two allocations before they were reused.
	require.Less(t, allocs, 0.5)
}
