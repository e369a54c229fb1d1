package core

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// The lazy sync deadline behaves as context.WithTimeout: Err reports the
// deadline before anything waited, Done closes at the deadline and when
// the parent ends, and stop releases the timer.
func TestDeadlineContext(t *testing.T) {
	var d deadlineContext
	d.start(context.Background(), 50*time.Millisecond)
	require.NoError(t, d.Err())
	dl, ok := d.Deadline()
	require.True(t, ok)
	require.WithinDuration(t, time.Now().Add(50*time.Millisecond), dl, 20*time.Millisecond)
	require.Nil(t, d.ctx, "no timer before something waits")
	time.Sleep(60 * time.Millisecond)
	require.ErrorIs(t, d.Err(), context.DeadlineExceeded, "past the deadline with no timer made")
	d.stop()

	d.start(context.Background(), 30*time.Millisecond)
	select {
	case <-d.Done():
		require.ErrorIs(t, d.Err(), context.DeadlineExceeded)
	case <-time.After(2 * time.Second):
		t.Fatal("Done did not close at the deadline")
	}
	d.stop()
	require.Nil(t, d.ctx)

	parent, cancel := context.WithCancel(context.Background())
	d.start(parent, time.Hour)
	cancel()
	require.ErrorIs(t, d.Err(), context.Canceled, "the parent's end, before any wait")
	select {
	case <-d.Done():
	case <-time.After(2 * time.Second):
		t.Fatal("Done did not close with the parent")
	}
	d.stop()
}

// Synced notices are reused: a later transfer's sync sees only its own
// descriptors and digests, never a reused entry's leftovers.
func TestReusedNoticesCarryNothingOver(t *testing.T) {
	p := newPair(t, `{"verify": "digest"}`, "", 8*4096)
	for round := 0; round < 20; round++ {
		n := 1 + round%8 // entries grow and shrink
		descs := p.blocks(n, 4096)
		for i := range p.src.b {
			p.src.b[i] = byte(round)
		}
		res, err := p.send.Transfer(p.session, descs, TransferOptions{})
		require.NoError(t, err)
		require.NoError(t, p.recv.SyncTransfers([]uint64{res.ID}, 0), "round %d", round)
		for i := 0; i < n*4096; i++ {
			if p.dst.b[i] != byte(round) {
				t.Fatalf("round %d: byte %d is %d", round, i, p.dst.b[i])
			}
		}
	}
	require.Equal(t, 1, p.recv.notices.Kept(), "one entry, reused every round")
}
