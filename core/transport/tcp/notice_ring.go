package tcp

import (
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/core/logs"
	"github.com/mcguard/mcguard/core/wire"
)

// Completion notices through a same-host connection's notice ring
// (samehost.LeaseHolder.PostNotice): the sender's side posts there when
// nothing else of the connection is on its way to the target; the
// target's side takes them when its application syncs, before a notice
// that comes on the connection itself, and when the connection ends.

// noticeRing is a link's lease slot and its view of the slot's ring, and
// the lock that keeps its notices in order: the ring's, the socket's, and
// the handshake they are checked under (link.auth), which the syncs'
// takes read from other goroutines than the serve loop's.
type noticeRing struct {
	mu   sync.Mutex
	slot atomic.Int64 // -1: none; set under mu (setRingSlot)
	tail uint64       // what the target took of the ring
	buf  []byte
}

// postRinged tries the connection's ring for a notice: only where the
// socket carries nothing the target has not answered and nothing is
// buffered (the notice would overtake it; and a notice on the socket
// still unanswered may not be overtaken either, or its sequence number
// would be refused as a replay).
func (t *conn) postRinged(body []byte) bool {
	if t.lease == nil || t.unfenced || len(t.owed) != 0 || t.w.Buffered() != 0 {
		return false
	}
	if !t.lease.PostNotice(body) {
		return false
	}
	if t.ringed != nil {
		t.ringed.Add(1)
	}
	return true
}

// ringNotices takes l's ring's notices; l.ring.mu held.
func (t *target) ringNotices(l *link) {
	slot := int(l.ring.slot.Load())
	if slot < 0 || t.notice == nil {
		return
	}
	var ok bool
	l.ring.buf, ok = t.lease.TakeNotices(slot, &l.ring.tail, l.ring.buf, func(body []byte) {
		if err := t.notice(body, nil, &l.auth); err != nil {
			logs.Printf(logs.Info, "target %s: completion notice refused: %v", t.addr(), err)
			t.lease.RefuseNotice(slot, wire.NoticeID(body)) // its sender's next call says so
		}
	})
	if !ok {
		logs.Printf(logs.Warn, "target %s: a same-host sender's notice ring does not add up; its notices are dropped", t.addr())
	}
}

// takeRingNotices takes the notices in every connection's ring (a sync
// looks for its notice); false where there are no rings (no lease).
func (t *target) takeRingNotices() bool {
	if t.lease == nil {
		return false
	}
	if t.lease.Writers() == 0 {
		return true
	}
	t.ringTake.Lock() // one at a time: they share the scratch list
	defer t.ringTake.Unlock()
	t.mu.Lock()
	for _, l := range t.conns {
		if l.ring.slot.Load() >= 0 {
			t.ringed = append(t.ringed, l)
		}
	}
	t.mu.Unlock()
	for _, l := range t.ringed {
		l.ring.mu.Lock()
		if slot := int(l.ring.slot.Load()); slot >= 0 && t.lease.RingPending(slot, l.ring.tail) {
			t.ringNotices(l)
		}
		l.ring.mu.Unlock()
	}
	clear(t.ringed)
	t.ringed = t.ringed[:0]
	return true
}

// setRingSlot gives l the ring of its lease slot (-1: none), taking what
// the ring of the one before still held.
func (t *target) setRingSlot(l *link, slot int) {
	l.ring.mu.Lock()
	defer l.ring.mu.Unlock()
	t.ringNotices(l)
	l.ring.slot.Store(int64(slot))
	l.ring.tail = 0
}

// ringRefusal is the target's refusal of one of this connection's ring
// notices since the last call, or nil.
func (t *conn) ringRefusal() error {
	if t.lease == nil {
		return nil
	}
	if id := t.lease.TakeRefusal(); id != 0 {
		return fmt.Errorf("%w: the receiver refused the completion notice of transfer %#x; its log says why", errs.Session, id)
	}
	return nil
}
