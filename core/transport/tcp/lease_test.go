package tcp

import (
	"context"
	"encoding/hex"
	"github.com/mcguard/mcguard/core/desc"
	"os"
	"os/exec"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/core/sharedmem"
)

// newLeasePair is a target's lease and a sender's view of it, in this
// process (pidfd_getfd of our own descriptor, as another process would).
// leaseWithWriter is a lease pair with one region, [0x10000, +0x1000),
// and the sender in the middle of a write into it.
func leaseWithWriter(t *testing.T, timeout time.Duration) (*lease, *pushLease) {
	l, p := newLeasePair(t, timeout)
	l.add(0x10000, 0x1000, sharedmem.File{})
	ok, err := p.enter(rng(0x10000, 0x1000))
	require.NoError(t, err)
	require.True(t, ok)
	return l, p
}

func newLeasePair(t *testing.T, timeout time.Duration) (*lease, *pushLease) {
	l, err := newLease(timeout)
	require.NoError(t, err)
	t.Cleanup(l.close)
	slot, epoch := l.assign("sender", os.Getpid())
	require.GreaterOrEqual(t, slot, 0)
	p, why := attachLease(os.Getpid(), l.fd, hex.EncodeToString(l.nonce[:]), slot, epoch)
	require.Empty(t, why)
	t.Cleanup(p.close)
	return l, p
}

func rng(addr, n uint64) []desc.Range { return []desc.Range{{Addr: addr, Len: n}} }

func TestLeaseCoversOnlyTheTable(t *testing.T) {
	l, p := newLeasePair(t, time.Second)
	l.add(0x10000, 0x1000, sharedmem.File{})
	l.add(0x40000, 0x2000, sharedmem.File{})
	ok, err := p.enter([]desc.Range{{Addr: 0x10000, Len: 0x1000}, {Addr: 0x41000, Len: 0x1000}})
	require.NoError(t, err)
	require.True(t, ok)
	p.exit()
	for _, r := range []desc.Range{{Addr: 0x10800, Len: 0x1000}, {Addr: 0x20000, Len: 1}, {Addr: 0x10000, Len: 0}, {Addr: ^uint64(0), Len: 2}} {
		ok, err := p.enter([]desc.Range{r})
		require.NoError(t, err)
		require.False(t, ok, "%+v is not inside one registered region", r)
	}
	require.Zero(t, atomic.LoadUint64(p.mem.busy(p.slot)), "a refused enter leaves the slot idle")
}

func TestLeaseAttachRefusesAnotherFile(t *testing.T) {
	l, err := newLease(time.Second)
	require.NoError(t, err)
	defer l.close()
	_, why := attachLease(os.Getpid(), l.fd, hex.EncodeToString(make([]byte, leaseNonceSize)), 0, 1)
	require.Contains(t, why, "not the one its handshake named")
	_, why = attachLease(os.Getpid(), 9999, hex.EncodeToString(l.nonce[:]), 0, 1)
	require.Contains(t, why, "pidfd_getfd")
}

// Unregister waits for a write that entered before it, and a write that
// begins after it finds the region gone.
func TestLeaseRemoveWaitsForAWriterAndShutsOutTheNext(t *testing.T) {
	l, p := leaseWithWriter(t, 5*time.Second)
	removed := make(chan error, 1)
	go func() { removed <- l.remove(0x10000) }()
	select {
	case <-removed:
		t.Fatal("remove returned while a write into the region was in progress")
	case <-time.After(50 * time.Millisecond):
	}
	p.exit()
	require.NoError(t, <-removed)
	ok, err := p.enter(rng(0x10000, 0x1000))
	require.NoError(t, err)
	require.False(t, ok, "after remove the region is not in the table")
}

func TestLeaseRemoveFailsWhereAWriterNeverFinishes(t *testing.T) {
	l, p := leaseWithWriter(t, 50*time.Millisecond)
	defer p.exit()
	err := l.remove(0x10000)
	require.ErrorContains(t, err, "still writing into this process")
}

// A writer that entered under a newer gen is not waited for: a settle
// waits only for what began before it.
func TestLeaseSettleWaitsOnlyForOlderWriters(t *testing.T) {
	l, p := newLeasePair(t, time.Second)
	l.add(0x10000, 0x1000, sharedmem.File{})
	require.NoError(t, l.settle(context.Background()))
	ok, _ := p.enter(rng(0x10000, 0x1000))
	require.True(t, ok)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Millisecond)
	defer cancel()
	require.Error(t, l.settle(ctx), "a writer that entered before this settle is waited for")
	p.exit()
	require.NoError(t, l.settle(context.Background()))
}

func TestLeaseRevokeStopsTheSendersWrites(t *testing.T) {
	l, p := newLeasePair(t, time.Second)
	l.add(0x10000, 0x1000, sharedmem.File{})
	require.NoError(t, l.revoke(context.Background(), "someone else"))
	ok, err := p.enter(rng(0x10000, 0x1000))
	require.NoError(t, err)
	require.True(t, ok)
	p.exit()
	require.NoError(t, l.revoke(context.Background(), "sender"))
	_, err = p.enter(rng(0x10000, 0x1000))
	require.ErrorIs(t, err, errRevoked)
}

// A writer whose process died mid-write does not hold up unregister, and
// its slot is free again when its connection ends.
func TestLeaseADeadWriterHoldsNothing(t *testing.T) {
	l, err := newLease(5 * time.Second)
	require.NoError(t, err)
	defer l.close()
	l.add(0x10000, 0x1000, sharedmem.File{})
	cmd := exec.Command("sleep", "30")
	require.NoError(t, cmd.Start())
	slot, _ := l.assign("dead", cmd.Process.Pid)
	require.GreaterOrEqual(t, slot, 0)
	atomic.StoreUint64(l.mem.busy(slot), atomic.LoadUint64(l.mem.gen())+1) // it entered, then died
	cmd.Process.Kill()
	cmd.Wait()
	start := time.Now()
	require.NoError(t, l.remove(0x10000))
	require.Less(t, time.Since(start), time.Second)
	l.release(slot)
	again, _ := l.assign("next", os.Getpid())
	require.Equal(t, slot, again, "the slot is free again")
}

func TestLeaseSlotsAreBounded(t *testing.T) {
	l, err := newLease(time.Second)
	require.NoError(t, err)
	defer l.close()
	for i := 0; i < maxLeaseSlots; i++ {
		slot, _ := l.assign("s", os.Getpid())
		require.Equal(t, i, slot)
	}
	slot, _ := l.assign("s", os.Getpid())
	require.Equal(t, -1, slot, "past the bound a connection gets no slot")
	l.release(7)
	slot, _ = l.assign("s", os.Getpid())
	require.Equal(t, 7, slot)
}

// A slot handed to a new connection is never the old one's: the old
// connection's epoch no longer owns it, even though the slot is in use.
func TestLeaseAReassignedSlotRefusesItsFormerConnection(t *testing.T) {
	l, p := newLeasePair(t, time.Second)
	l.add(0x10000, 0x1000, sharedmem.File{})
	l.release(p.slot)
	slot, epoch := l.assign("sender", os.Getpid())
	require.Equal(t, p.slot, slot)
	require.NotEqual(t, p.epoch, epoch)
	_, err := p.enter(rng(0x10000, 0x1000))
	require.ErrorIs(t, err, errRevoked)
	q, why := attachLease(os.Getpid(), l.fd, hex.EncodeToString(l.nonce[:]), slot, epoch)
	require.Empty(t, why)
	defer q.close()
	ok, err := q.enter(rng(0x10000, 0x1000))
	require.NoError(t, err)
	require.True(t, ok)
	q.exit()
}

// Closing the target empties the table: a sender's mapping outlives it,
// and must not lead to writes into memory the process may free.
func TestLeaseCloseShutsOutEverySender(t *testing.T) {
	l, err := newLease(time.Second)
	require.NoError(t, err)
	l.add(0x10000, 0x1000, sharedmem.File{})
	slot, epoch := l.assign("sender", os.Getpid())
	p, why := attachLease(os.Getpid(), l.fd, hex.EncodeToString(l.nonce[:]), slot, epoch)
	require.Empty(t, why)
	defer p.close()
	l.close()
	ok, err := p.enter(rng(0x10000, 0x1000))
	require.False(t, ok)
	require.ErrorIs(t, err, errRevoked)
}
