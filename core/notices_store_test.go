package core

import (
	"fmt"
	"maps"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/core/desc"
	"github.com/mcguard/mcguard/core/errs"
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
	add := func(id uint64) { // from eight senders, each within its own bound
		n := wire.Notice{ID: id, Total: 1, Descs: []wire.NoticeDesc{{Dst: 4096, Len: 64}}}
		require.NoError(t, s.add(n, countedLanded{&released}, fmt.Sprint("sender ", id%8)))
	}
	const extra = 10
	for id := uint64(1); id <= maxNoticeEntries+extra; id++ {
		add(id)
	}
	require.Len(t, s.entries, maxNoticeEntries)
	require.Equal(t, extra, released, "each dropped notice released its landed digests")
	w := newNoticeWaiter()
	_, err := s.take(1, &w, time.Now().Add(time.Second), nil)
	require.ErrorIs(t, err, errs.Session)
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
		if err := s.add(n, landed, "sender 0"); err != nil {
			t.Fatal(err)
		}
	})
	// The arrival order's slice is amortised, as are the maps' growth;
	// an entry per notice was two allocations before they were reused.
	require.Less(t, allocs, 0.5)
}

// One sender whose notices are never synced drops its own oldest past its
// bound, not another sender's: the other's notice stays to be synced. A
// sender's bound counts descriptors too, and the notice being added is
// never dropped, however large.
func TestNoticesAreBoundedPerSender(t *testing.T) {
	s := newNoticeStore()
	released := 0
	one := []wire.NoticeDesc{{Dst: 4096, Len: 64}}
	require.NoError(t, s.add(wire.Notice{ID: 1, Total: 1, Descs: one}, countedLanded{&released}, "patient"))
	const flood = maxNoticeEntriesPerSender + 100
	for id := uint64(2); id < 2+flood; id++ {
		require.NoError(t, s.add(wire.Notice{ID: id, Total: 1, Descs: one}, countedLanded{&released}, "flooder"))
	}
	require.Len(t, s.entries, maxNoticeEntriesPerSender+1)
	require.Equal(t, noticeLoad{maxNoticeEntriesPerSender, maxNoticeEntriesPerSender}, s.perSender["flooder"])
	require.Equal(t, 100, released, "the flooder's oldest went, their landed digests released")

	w := newNoticeWaiter()
	e, err := s.take(1, &w, time.Now().Add(time.Second), nil)
	require.NoError(t, err, "the other sender's notice was kept")
	s.release(e)
	_, err = s.take(2, &w, time.Now().Add(time.Second), nil)
	require.ErrorIs(t, err, errs.Session)
	require.Contains(t, err.Error(), "dropped")
	e, err = s.take(2+flood-1, &w, time.Now().Add(time.Second), nil)
	require.NoError(t, err, "the flooder's newest kept")
	s.release(e)
	require.NotContains(t, s.perSender, "patient", "a sender with no notices left is forgotten")

	// Descriptors: a notice of more than a sender's bound is taken whole,
	// and the flooder's other notices go to make room for it.
	big := make([]wire.NoticeDesc, wire.MaxNoticeDescs)
	for i := range big {
		big[i] = wire.NoticeDesc{Dst: 4096, Len: 64}
	}
	const id = 1 << 40
	total := maxNoticeDescsPerSender + wire.MaxNoticeDescs
	for base := 0; base < total; base += len(big) {
		require.NoError(t, s.add(wire.Notice{ID: id, Total: total, Base: base, Descs: big}, nil, "flooder"))
	}
	require.Equal(t, noticeLoad{1, total}, s.perSender["flooder"])
	require.Len(t, s.entries, 1)
	require.Equal(t, total, s.descs)
	e, err = s.take(id, &w, time.Now().Add(time.Second), nil)
	require.NoError(t, err)
	s.release(e)
	require.Empty(t, s.perSender)
	require.Zero(t, s.descs)
	require.Empty(t, s.order)
}

// A chunk from another sender under an id a sender holds, its first or
// a continuation, is refused, and neither sender's notice is believed: a
// sync of the id fails rather than take the one that came first.
func TestAnIDTwoSendersClaimIsBelievedOfNeither(t *testing.T) {
	for _, base := range []int{0, 1} {
		s := newNoticeStore()
		one := []wire.NoticeDesc{{Dst: 4096, Len: 64}}
		require.NoError(t, s.add(wire.Notice{ID: 7, Total: 2, Descs: one}, nil, "a"))
		require.ErrorIs(t, s.add(wire.Notice{ID: 7, Total: 2, Base: base, Descs: one}, nil, "b"), errNotice)
		require.ErrorIs(t, s.add(wire.Notice{ID: 7, Total: 2, Base: 1, Descs: one}, nil, "a"), errNotice)
		w := newNoticeWaiter()
		_, err := s.take(7, &w, time.Now().Add(time.Second), nil)
		require.ErrorIs(t, err, errs.Session)
		require.Contains(t, err.Error(), "two senders")
		require.Empty(t, s.entries)
		require.Empty(t, s.perSender)
		require.Zero(t, s.descs)
		require.NoError(t, s.add(wire.Notice{ID: 8, Total: 1, Descs: one}, nil, "a"), "other ids go on")
	}
}

// At the bound in all, a transfer's notice whose next chunk arrives is
// kept: the others' oldest go to make room for it, though it is older.
func TestAContinuedNoticeIsKeptAtTheBound(t *testing.T) {
	s := newNoticeStore()
	one := []wire.NoticeDesc{{Dst: 4096, Len: 64}}
	require.NoError(t, s.add(wire.Notice{ID: 1, Total: 1 + len(one)*wire.MaxNoticeDescs, Descs: one}, nil, "a"))
	big := make([]wire.NoticeDesc, wire.MaxNoticeDescs)
	id := uint64(100)
	for s.descs+len(big) <= maxNoticeDescs { // others fill the bound, each within its own
		id++
		require.NoError(t, s.add(wire.Notice{ID: id, Total: len(big), Descs: big}, nil, fmt.Sprint("sender ", id%5)))
	}
	chunk := make([]wire.NoticeDesc, wire.MaxNoticeDescs)
	require.NoError(t, s.add(wire.Notice{ID: 1, Total: 1 + wire.MaxNoticeDescs, Base: 1, Descs: chunk}, nil, "a"))
	require.LessOrEqual(t, s.descs, maxNoticeDescs)
	w := newNoticeWaiter()
	e, err := s.take(1, &w, time.Now().Add(time.Second), nil)
	require.NoError(t, err)
	require.Len(t, e.descs, 1+wire.MaxNoticeDescs)
	s.release(e)
	_, err = s.take(101, &w, time.Now().Add(time.Second), nil)
	require.ErrorContains(t, err, "dropped", "the others' oldest went instead")
}

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
	p.recv.notices.mu.Lock()
	loads := maps.Clone(p.recv.notices.perSender)
	p.recv.notices.mu.Unlock()
	require.Len(t, loads, 2)
	for sender, load := range loads {
		require.Equal(t, noticeLoad{3, 3}, load, sender)
	}
	require.NoError(t, p.recv.SyncTransfers(ids, 0))
	require.Empty(t, p.recv.notices.perSender)
}
