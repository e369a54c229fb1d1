package tcp

import (
	"errors"
	"time"

	"github.com/mcguard/mcguard/core/fault"
	"github.com/mcguard/mcguard/core/memory"
	"github.com/mcguard/mcguard/core/transport"
	"github.com/mcguard/mcguard/core/wire"
)

// Fault injection at the TCP target: what the target does with a write
// when a fault is on (core/fault decides its fate).

// writeFaulty is a write under fault injection: the bytes are received
// whole, acknowledged, and then applied as the fault decides.
func (t *target) writeFaulty(l *link, addr, n uint64, src source, lagged *transport.Pending) (wire.Status, error) {
	ack := l.ack.Load() // where this write stands in its stream
	buf := make([]byte, n)
	if err := src.fill(buf); err != nil {
		var pe errPeerRead
		if errors.As(err, &pe) {
			return wire.StatusNoAccess, nil
		}
		return 0, err
	}
	var dstTail []byte
	if t.faults.Mode() == fault.Stale {
		k := min(uint64(t.faults.TailBytes()), n)
		dstTail, _ = t.regions.Copy(addr+n-k, k)
	}
	now, hold := t.faults.Fate(buf, dstTail)
	if t.faults.Mode() == fault.Hold && hold {
		return t.writeHeld(l, ack, addr, buf), nil
	}
	if t.q.refuses(ack, memory.Region{Addr: addr, Len: n}) {
		return wire.StatusQuiesced, nil
	}
	if len(now) > 0 {
		t.regions.Store(addr, uint64(len(now)), func(m []byte) error { copy(m, now); return nil })
	}
	if !hold {
		return wire.StatusOK, nil
	}
	w := memory.Region{Addr: addr, Len: n}
	id := t.pending.Add(w)
	var lagID uint64
	if t.faults.Mode() == fault.Lag {
		lagID = lagged.Add(w)
	}
	t.late.Add(1)
	time.AfterFunc(t.faults.Delay(), func() {
		defer t.late.Done()
		t.applyMu.Lock()
		if !t.closed {
			t.regions.Store(addr, n, func(m []byte) error { copy(m, buf); return nil })
		}
		t.applyMu.Unlock()
		t.pending.Done(id)
		if lagID != 0 {
			lagged.Done(lagID)
		}
	})
	return wire.StatusOK, nil
}

// writeHeld applies a write that the hold fault keeps back, as a slow path
// would deliver it: late, with the connection's later frames behind it.
// It is checked when it arrives, against where it stood in its stream, so
// a quiesce or an abort in the meantime refuses it.
func (t *target) writeHeld(l *link, ack, addr uint64, buf []byte) wire.Status {
	select {
	case <-time.After(t.faults.Delay()):
	case <-t.stop:
		return wire.StatusQuiesced // the guard is closing: nothing more lands
	}
	w := memory.Region{Addr: addr, Len: uint64(len(buf))}
	id := t.pending.Add(w)
	defer t.pending.Done(id)
	l.applyMu.Lock()
	defer l.applyMu.Unlock()
	if l.aborted.Load() || t.q.refuses(ack, w) {
		return wire.StatusQuiesced
	}
	if err := t.regions.Store(addr, w.Len, func(m []byte) error { copy(m, buf); return nil }); err != nil {
		return wire.StatusNotRegistered
	}
	return wire.StatusOK
}
