package transport

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/core/memory"
)

// A wait returns once no pending write overlaps its ranges (any, for
// nil); writes that do not overlap do not hold it; a context ends it.
func TestPendingWaitsForOverlappingWrites(t *testing.T) {
	h := NewPending()
	require.True(t, h.Empty())
	a := h.Add(memory.Region{Addr: 0, Len: 100})
	b := h.Add(memory.Region{Addr: 1000, Len: 100})
	require.NotZero(t, a, "0 is no write's id: callers keep it for none")
	require.False(t, h.Empty())

	require.NoError(t, h.Wait(context.Background(), []memory.Region{{Addr: 500, Len: 100}}), "no overlap: no wait")
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	require.ErrorIs(t, h.Wait(ctx, []memory.Region{{Addr: 50, Len: 10}}), context.DeadlineExceeded)

	done := make(chan error, 1)
	go func() { done <- h.Wait(context.Background(), []memory.Region{{Addr: 1050, Len: 1}}) }()
	time.Sleep(10 * time.Millisecond)
	h.Done(a)
	select {
	case <-done:
		t.Fatal("returned while the overlapping write was still pending")
	case <-time.After(10 * time.Millisecond):
	}
	h.Done(b)
	require.NoError(t, <-done)
	require.True(t, h.Empty())

	go func() { done <- h.Wait(context.Background(), nil) }()
	require.NoError(t, <-done, "nothing pending: a wait for any returns")
	h.Done(0) // no write's
	require.True(t, h.Empty())
}

// Slots are reused: a steady stream of writes allocates nothing and the
// table stays as large as the most writes pending at once.
func TestPendingReusesSlots(t *testing.T) {
	h := NewPending()
	ids := make([]uint64, 8)
	cycle := func() {
		for i := range ids {
			ids[i] = h.Add(memory.Region{Addr: uint64(i) << 12, Len: 4096})
		}
		for _, id := range ids {
			h.Done(id)
		}
	}
	cycle()
	require.Zero(t, testing.AllocsPerRun(1000, cycle))
	require.Len(t, h.writes, len(ids))
	require.True(t, h.Empty())
}
