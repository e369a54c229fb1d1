package samehost

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// takeAll takes what slot's ring holds, as copies.
func takeAll(l *Lease, slot int, tail *uint64) ([][]byte, bool) {
	var got [][]byte
	_, ok := l.TakeNotices(slot, tail, nil, func(b []byte) { got = append(got, bytes.Clone(b)) })
	return got, ok
}

func notice(i, n int) []byte {
	b := bytes.Repeat([]byte{byte(i)}, n)
	binary.LittleEndian.PutUint32(b, uint32(i))
	return b
}

func TestNoticeRingKeepsOrderAcrossWraps(t *testing.T) {
	l, p := newLeasePair(t, time.Second)
	var tail uint64
	next, want := 0, 0
	for round := 0; round < 50; round++ {
		// Records of varied lengths, some taken between rounds: the ring
		// wraps at every length and position.
		for k := 0; k < 1+round%7; k++ {
			if !p.PostNotice(notice(next, 100+37*((next*13)%97))) {
				break
			}
			next++
		}
		got, ok := takeAll(l, p.slot, &tail)
		require.True(t, ok)
		for _, b := range got {
			require.Equal(t, notice(want, 100+37*((want*13)%97)), b, "notice %d", want)
			want++
		}
	}
	require.Equal(t, next, want)
	require.Greater(t, atomic.LoadUint64(p.mem.ringHead(p.slot)), uint64(3*ringSize), "the ring wrapped several times")
	require.Zero(t, atomic.LoadUint64(p.mem.busy(p.slot)), "a post leaves the slot idle")
}

func TestNoticeRingFullRefusesUntilTaken(t *testing.T) {
	l, p := newLeasePair(t, time.Second)
	n := 0
	for p.PostNotice(notice(n, 1000)) {
		n++
		require.Less(t, n, 100, "a ring of %d bytes holds a bounded number of notices", ringSize)
	}
	require.Equal(t, ringSize/int(ringRecord(1000)), n)
	require.False(t, p.PostNotice(make([]byte, MaxRingNotice+1)), "too long for any ring")
	require.False(t, p.PostNotice(nil), "empty")
	var tail uint64
	got, ok := takeAll(l, p.slot, &tail)
	require.True(t, ok)
	require.Len(t, got, n)
	require.True(t, p.PostNotice(notice(n, 1000)), "taken notices make room")
}

func TestNoticeRingOfAReleasedSlotIsTakenThenClosed(t *testing.T) {
	l, p := newLeasePair(t, time.Second)
	require.True(t, p.PostNotice(notice(1, 64)))
	var got [][]byte
	l.Release(p.slot, func() {
		var tail uint64
		got, _ = takeAll(l, p.slot, &tail)
	})
	require.Len(t, got, 1, "a connection that ends has its ring's notices taken")
	require.False(t, p.PostNotice(notice(2, 64)), "the slot is no longer the sender's")
	slot, _ := l.Assign("another", p.pid)
	require.Equal(t, p.slot, slot)
	require.False(t, l.RingPending(slot, 0), "a slot handed out again starts with an empty ring")
}

// A sender that writes nonsense into its ring (lengths, head) loses its
// notices; the target neither reads outside the ring nor loops.
func TestNoticeRingThatDoesNotAddUpIsDropped(t *testing.T) {
	for _, c := range []struct {
		name  string
		spoil func(p *LeaseHolder)
	}{
		{"head far ahead", func(p *LeaseHolder) { atomic.StoreUint64(p.mem.ringHead(p.slot), 10*ringSize) }},
		{"head inside a record", func(p *LeaseHolder) { atomic.StoreUint64(p.mem.ringHead(p.slot), 8) }},
		{"length past the head", func(p *LeaseHolder) { binary.LittleEndian.PutUint32(p.mem.ring(p.slot), 5000) }},
		{"length past the ring", func(p *LeaseHolder) { binary.LittleEndian.PutUint32(p.mem.ring(p.slot), 0xfffffff0) }},
		{"zero length", func(p *LeaseHolder) { binary.LittleEndian.PutUint32(p.mem.ring(p.slot), 0) }},
		{"wrap at the start", func(p *LeaseHolder) { binary.LittleEndian.PutUint32(p.mem.ring(p.slot), ringWrap) }},
	} {
		t.Run(c.name, func(t *testing.T) {
			l, p := newLeasePair(t, time.Second)
			require.True(t, p.PostNotice(notice(1, 200)))
			require.True(t, p.PostNotice(notice(2, 200)))
			c.spoil(p)
			var tail uint64
			got, ok := takeAll(l, p.slot, &tail)
			require.False(t, ok)
			require.Empty(t, got)
			require.False(t, l.RingPending(p.slot, tail), "what was left is dropped")
		})
	}
}

func TestNoticeRingConcurrentPostAndTake(t *testing.T) {
	l, p := newLeasePair(t, time.Second)
	const total = 20000
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := 0; i < total; {
			if p.PostNotice(notice(i, 64+i%300)) {
				i++
			}
		}
	}()
	var tail uint64
	want := 0
	for want < total {
		got, ok := takeAll(l, p.slot, &tail)
		require.True(t, ok)
		for _, b := range got {
			require.Equal(t, notice(want, 64+want%300), b, fmt.Sprintf("notice %d", want))
			want++
		}
	}
	<-done
}
