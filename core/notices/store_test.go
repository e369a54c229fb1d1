package notices

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

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
	s := NewStore()
	released := 0
	add := func(id uint64) { // from eight senders, each within its own bound
		n := wire.Notice{ID: id, Total: 1, Descs: []wire.NoticeDesc{{Dst: 4096, Len: 64}}}
		require.NoError(t, s.Add(n, countedLanded{&released}, fmt.Sprint("sender ", id%8)))
	}
	const extra = 10
	for id := uint64(1); id <= maxNoticeEntries+extra; id++ {
		add(id)
	}
	require.Len(t, s.entries, maxNoticeEntries)
	require.Equal(t, extra, released, "each dropped notice released its landed digests")
	w := NewWaiter()
	_, err := s.Take(1, &w, time.Now().Add(time.Second), nil, nil)
	require.ErrorIs(t, err, errs.Session)
	require.Contains(t, err.Error(), "dropped")
	e, err := s.Take(extra+1, &w, time.Now().Add(time.Second), nil, nil)
	require.NoError(t, err, "the oldest kept")
	s.Release(e)

	next := uint64(maxNoticeEntries + extra + 1)
	n := wire.Notice{Total: 1, Descs: []wire.NoticeDesc{{Dst: 4096, Len: 64}}}
	landed := countedLanded{&released}
	allocs := testing.AllocsPerRun(1000, func() {
		n.ID = next
		next++
		if err := s.Add(n, landed, "sender 0"); err != nil {
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
	s := NewStore()
	released := 0
	one := []wire.NoticeDesc{{Dst: 4096, Len: 64}}
	require.NoError(t, s.Add(wire.Notice{ID: 1, Total: 1, Descs: one}, countedLanded{&released}, "patient"))
	const flood = maxNoticeEntriesPerSender + 100
	for id := uint64(2); id < 2+flood; id++ {
		require.NoError(t, s.Add(wire.Notice{ID: id, Total: 1, Descs: one}, countedLanded{&released}, "flooder"))
	}
	require.Len(t, s.entries, maxNoticeEntriesPerSender+1)
	require.Equal(t, Load{Entries: maxNoticeEntriesPerSender, Descs: maxNoticeEntriesPerSender}, s.perSender["flooder"])
	require.Equal(t, 100, released, "the flooder's oldest went, their landed digests released")

	w := NewWaiter()
	e, err := s.Take(1, &w, time.Now().Add(time.Second), nil, nil)
	require.NoError(t, err, "the other sender's notice was kept")
	s.Release(e)
	_, err = s.Take(2, &w, time.Now().Add(time.Second), nil, nil)
	require.ErrorIs(t, err, errs.Session)
	require.Contains(t, err.Error(), "dropped")
	e, err = s.Take(2+flood-1, &w, time.Now().Add(time.Second), nil, nil)
	require.NoError(t, err, "the flooder's newest kept")
	s.Release(e)
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
		require.NoError(t, s.Add(wire.Notice{ID: id, Total: total, Base: base, Descs: big}, nil, "flooder"))
	}
	require.Equal(t, Load{Entries: 1, Descs: total}, s.perSender["flooder"])
	require.Len(t, s.entries, 1)
	require.Equal(t, total, s.descs)
	e, err = s.Take(id, &w, time.Now().Add(time.Second), nil, nil)
	require.NoError(t, err)
	s.Release(e)
	require.Empty(t, s.perSender)
	require.Zero(t, s.descs)
	require.Empty(t, s.order)
}

// A chunk from another sender under an id a sender holds, its first or
// a continuation, is refused, and neither sender's notice is believed: a
// sync of the id fails rather than take the one that came first.
func TestAnIDTwoSendersClaimIsBelievedOfNeither(t *testing.T) {
	for _, base := range []int{0, 1} {
		s := NewStore()
		one := []wire.NoticeDesc{{Dst: 4096, Len: 64}}
		require.NoError(t, s.Add(wire.Notice{ID: 7, Total: 2, Descs: one}, nil, "a"))
		require.ErrorIs(t, s.Add(wire.Notice{ID: 7, Total: 2, Base: base, Descs: one}, nil, "b"), ErrNotice)
		require.ErrorIs(t, s.Add(wire.Notice{ID: 7, Total: 2, Base: 1, Descs: one}, nil, "a"), ErrNotice)
		w := NewWaiter()
		_, err := s.Take(7, &w, time.Now().Add(time.Second), nil, nil)
		require.ErrorIs(t, err, errs.Session)
		require.Contains(t, err.Error(), "two senders")
		require.Empty(t, s.entries)
		require.Empty(t, s.perSender)
		require.Zero(t, s.descs)
		require.NoError(t, s.Add(wire.Notice{ID: 8, Total: 1, Descs: one}, nil, "a"), "other ids go on")
	}
}

// At the bound in all, a transfer's notice whose next chunk arrives is
// kept: the others' oldest go to make room for it, though it is older.
func TestAContinuedNoticeIsKeptAtTheBound(t *testing.T) {
	s := NewStore()
	one := []wire.NoticeDesc{{Dst: 4096, Len: 64}}
	require.NoError(t, s.Add(wire.Notice{ID: 1, Total: 1 + len(one)*wire.MaxNoticeDescs, Descs: one}, nil, "a"))
	big := make([]wire.NoticeDesc, wire.MaxNoticeDescs)
	id := uint64(100)
	for s.descs+len(big) <= maxNoticeDescs { // others fill the bound, each within its own
		id++
		require.NoError(t, s.Add(wire.Notice{ID: id, Total: len(big), Descs: big}, nil, fmt.Sprint("sender ", id%5)))
	}
	chunk := make([]wire.NoticeDesc, wire.MaxNoticeDescs)
	require.NoError(t, s.Add(wire.Notice{ID: 1, Total: 1 + wire.MaxNoticeDescs, Base: 1, Descs: chunk}, nil, "a"))
	require.LessOrEqual(t, s.descs, maxNoticeDescs)
	w := NewWaiter()
	e, err := s.Take(1, &w, time.Now().Add(time.Second), nil, nil)
	require.NoError(t, err)
	require.Len(t, e.Descs, 1+wire.MaxNoticeDescs)
	s.Release(e)
	_, err = s.Take(101, &w, time.Now().Add(time.Second), nil, nil)
	require.ErrorContains(t, err, "dropped", "the others' oldest went instead")
}

// A notice that comes without waking anyone (a same-host sender's ring)
// is found by the poll: at once when it is there, and while the sync
// waits when it comes later.
func TestTakePollsForNoticesThatWakeNobody(t *testing.T) {
	s := NewStore()
	w := NewWaiter()
	n := wire.Notice{ID: 9, Total: 1, Descs: []wire.NoticeDesc{{Dst: 4096, Len: 64}}}
	polls := 0
	poll := func() bool {
		polls++
		if polls == 5 {
			require.NoError(t, s.Add(n, nil, "sender"))
		}
		return true
	}
	start := time.Now()
	e, err := s.Take(9, &w, time.Now().Add(10*time.Second), nil, poll)
	require.NoError(t, err)
	s.Release(e)
	require.Equal(t, 5, polls)
	require.Less(t, time.Since(start), time.Second, "polled, not waited out")

	polls = 0
	_, err = s.Take(10, &w, time.Now().Add(30*time.Millisecond), nil, func() bool { polls++; return true })
	require.ErrorIs(t, err, errs.Timeout)
	require.Greater(t, polls, 5, "polled while it waited")

	polls = 0
	_, err = s.Take(11, &w, time.Now().Add(30*time.Millisecond), nil, func() bool { polls++; return false })
	require.ErrorIs(t, err, errs.Timeout)
	require.Equal(t, 1, polls, "no rings: polled once")
}

// BenchmarkAdd is one notice's arrival at a store below its bounds
// (the application syncs) and at one sender's bound (it never does:
// each arrival drops the sender's oldest).
func BenchmarkAdd(b *testing.B) {
	for _, at := range []struct {
		name string
		held int
	}{{"below", 0}, {"at-the-bound", maxNoticeEntriesPerSender}} {
		b.Run(at.name, func(b *testing.B) {
			s := NewStore()
			n := wire.Notice{Total: 1, Descs: []wire.NoticeDesc{{Dst: 4096, Len: 4096}}}
			w := NewWaiter()
			for id := 1; id <= at.held; id++ {
				n.ID = uint64(id)
				s.Add(n, nil, "sender")
			}
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				n.ID = uint64(at.held + 1 + i)
				if err := s.Add(n, nil, "sender"); err != nil {
					b.Fatal(err)
				}
				if at.held == 0 { // synced
					e, err := s.Take(n.ID, &w, time.Now().Add(time.Second), nil, nil)
					if err != nil {
						b.Fatal(err)
					}
					s.Release(e)
				}
			}
		})
	}
}
