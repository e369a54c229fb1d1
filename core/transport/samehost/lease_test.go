package samehost

import (
	"context"
	"encoding/hex"
	"os"
	"os/exec"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/core/desc"
)

// newLeasePair is a target's lease and a sender's view of it, in this
// process (pidfd_getfd of our own descriptor, as another process would).
// leaseWithWriter is a lease pair with one region, [0x10000, +0x1000),
// and the sender in the middle of a write into it.
func leaseWithWriter(t *testing.T, timeout time.Duration) (*Lease, *LeaseHolder) {
	l, p := newLeasePair(t, timeout)
	l.Add(0x10000, 0x1000, SharedFile{})
	ok, err := p.Enter(rng(0x10000, 0x1000))
	require.NoError(t, err)
	require.True(t, ok)
	return l, p
}

func newLeasePair(t *testing.T, timeout time.Duration) (*Lease, *LeaseHolder) {
	l, err := NewLease(timeout)
	require.NoError(t, err)
	t.Cleanup(l.Close)
	slot, epoch := l.Assign("sender", os.Getpid())
	require.GreaterOrEqual(t, slot, 0)
	p, why := AttachLease(os.Getpid(), l.fd, hex.EncodeToString(l.nonce[:]), slot, epoch)
	require.Empty(t, why)
	t.Cleanup(p.Close)
	return l, p
}

func rng(addr, n uint64) []desc.Range { return []desc.Range{{Addr: addr, Len: n}} }

func TestLeaseCoversOnlyTheTable(t *testing.T) {
	l, p := newLeasePair(t, time.Second)
	l.Add(0x10000, 0x1000, SharedFile{})
	l.Add(0x40000, 0x2000, SharedFile{})
	ok, err := p.Enter([]desc.Range{{Addr: 0x10000, Len: 0x1000}, {Addr: 0x41000, Len: 0x1000}})
	require.NoError(t, err)
	require.True(t, ok)
	p.Exit()
	for _, r := range []desc.Range{{Addr: 0x10800, Len: 0x1000}, {Addr: 0x20000, Len: 1}, {Addr: 0x10000, Len: 0}, {Addr: ^uint64(0), Len: 2}} {
		ok, err := p.Enter([]desc.Range{r})
		require.NoError(t, err)
		require.False(t, ok, "%+v is not inside one registered region", r)
	}
	require.Zero(t, atomic.LoadUint64(p.mem.busy(p.slot)), "a refused enter leaves the slot idle")
}

func TestLeaseAttachRefusesAnotherFile(t *testing.T) {
	l, err := NewLease(time.Second)
	require.NoError(t, err)
	defer l.Close()
	_, why := AttachLease(os.Getpid(), l.fd, hex.EncodeToString(make([]byte, leaseNonceSize)), 0, 1)
	require.Contains(t, why, "not the one its handshake named")
	_, why = AttachLease(os.Getpid(), 9999, hex.EncodeToString(l.nonce[:]), 0, 1)
	require.Contains(t, why, "pidfd_getfd")
}

// Unregister waits for a write that entered before it, and a write that
// begins after it finds the region gone.
func TestLeaseRemoveWaitsForAWriterAndShutsOutTheNext(t *testing.T) {
	l, p := leaseWithWriter(t, 5*time.Second)
	removed := make(chan error, 1)
	go func() { removed <- l.Remove(0x10000) }()
	select {
	case <-removed:
		t.Fatal("remove returned while a write into the region was in progress")
	case <-time.After(50 * time.Millisecond):
	}
	p.Exit()
	require.NoError(t, <-removed)
	ok, err := p.Enter(rng(0x10000, 0x1000))
	require.NoError(t, err)
	require.False(t, ok, "after remove the region is not in the table")
}

func TestLeaseRemoveFailsWhereAWriterNeverFinishes(t *testing.T) {
	l, p := leaseWithWriter(t, 50*time.Millisecond)
	defer p.Exit()
	err := l.Remove(0x10000)
	require.ErrorContains(t, err, "still writing into this process")
}

// A writer that entered under a newer gen is not waited for: a settle
// waits only for what began before it.
func TestLeaseSettleWaitsOnlyForOlderWriters(t *testing.T) {
	l, p := newLeasePair(t, time.Second)
	l.Add(0x10000, 0x1000, SharedFile{})
	require.NoError(t, l.Settle(context.Background()))
	ok, _ := p.Enter(rng(0x10000, 0x1000))
	require.True(t, ok)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Millisecond)
	defer cancel()
	require.Error(t, l.Settle(ctx), "a writer that entered before this settle is waited for")
	p.Exit()
	require.NoError(t, l.Settle(context.Background()))
}

func TestLeaseRevokeStopsTheSendersWrites(t *testing.T) {
	l, p := newLeasePair(t, time.Second)
	l.Add(0x10000, 0x1000, SharedFile{})
	require.NoError(t, l.Revoke(context.Background(), "someone else"))
	ok, err := p.Enter(rng(0x10000, 0x1000))
	require.NoError(t, err)
	require.True(t, ok)
	p.Exit()
	require.NoError(t, l.Revoke(context.Background(), "sender"))
	_, err = p.Enter(rng(0x10000, 0x1000))
	require.ErrorIs(t, err, ErrRevoked)
}

// A writer whose process died mid-write does not hold up unregister, and
// its slot is free again when its connection ends.
func TestLeaseADeadWriterHoldsNothing(t *testing.T) {
	l, err := NewLease(5 * time.Second)
	require.NoError(t, err)
	defer l.Close()
	l.Add(0x10000, 0x1000, SharedFile{})
	cmd := exec.Command("sleep", "30")
	require.NoError(t, cmd.Start())
	slot, _ := l.Assign("dead", cmd.Process.Pid)
	require.GreaterOrEqual(t, slot, 0)
	atomic.StoreUint64(l.mem.busy(slot), atomic.LoadUint64(l.mem.gen())+1) // it entered, then died
	cmd.Process.Kill()
	cmd.Wait()
	start := time.Now()
	require.NoError(t, l.Remove(0x10000))
	require.Less(t, time.Since(start), time.Second)
	l.Release(slot, nil)
	again, _ := l.Assign("next", os.Getpid())
	require.Equal(t, slot, again, "the slot is free again")
}

func TestLeaseSlotsAreBounded(t *testing.T) {
	l, err := NewLease(time.Second)
	require.NoError(t, err)
	defer l.Close()
	for i := 0; i < MaxLeaseSlots; i++ {
		slot, _ := l.Assign("s", os.Getpid())
		require.Equal(t, i, slot)
	}
	slot, _ := l.Assign("s", os.Getpid())
	require.Equal(t, -1, slot, "past the bound a connection gets no slot")
	l.Release(7, nil)
	slot, _ = l.Assign("s", os.Getpid())
	require.Equal(t, 7, slot)
}

// A slot handed to a new connection is never the old one's: the old
// connection's epoch no longer owns it, even though the slot is in use.
func TestLeaseAReassignedSlotRefusesItsFormerConnection(t *testing.T) {
	l, p := newLeasePair(t, time.Second)
	l.Add(0x10000, 0x1000, SharedFile{})
	l.Release(p.slot, nil)
	slot, epoch := l.Assign("sender", os.Getpid())
	require.Equal(t, p.slot, slot)
	require.NotEqual(t, p.epoch, epoch)
	_, err := p.Enter(rng(0x10000, 0x1000))
	require.ErrorIs(t, err, ErrRevoked)
	q, why := AttachLease(os.Getpid(), l.fd, hex.EncodeToString(l.nonce[:]), slot, epoch)
	require.Empty(t, why)
	defer q.Close()
	ok, err := q.Enter(rng(0x10000, 0x1000))
	require.NoError(t, err)
	require.True(t, ok)
	q.Exit()
}

// Closing the target empties the table: a sender's mapping outlives it,
// and must not lead to writes into memory the process may free.
func TestLeaseCloseShutsOutEverySender(t *testing.T) {
	l, err := NewLease(time.Second)
	require.NoError(t, err)
	l.Add(0x10000, 0x1000, SharedFile{})
	slot, epoch := l.Assign("sender", os.Getpid())
	p, why := AttachLease(os.Getpid(), l.fd, hex.EncodeToString(l.nonce[:]), slot, epoch)
	require.Empty(t, why)
	defer p.Close()
	l.Close()
	ok, err := p.Enter(rng(0x10000, 0x1000))
	require.False(t, ok)
	require.ErrorIs(t, err, ErrRevoked)
}
