package core

import (
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/mcguard/mcguard/core/transport"
	"github.com/mcguard/mcguard/core/wire"
	"github.com/mcguard/mcguard/verify"
)

// Bounds of what peers' notices may hold in a receiver's memory; past
// them the oldest notices are dropped (a sync for one then says so).
const (
	maxNoticeEntries = 1 << 16
	maxNoticeDescs   = 1 << 22
)

// notice is a transfer's completion notice as the receiver assembles it.
type notice struct {
	mode   verify.Mode
	total  int
	descs  []wire.NoticeDesc
	landed []transport.Landed // per chunk that came with the digests taken as it landed
}

func (n *notice) complete() bool { return len(n.descs) == n.total }

// noticeStore holds the notices a receiving guard was sent until the
// application syncs them.
type noticeStore struct {
	mu      sync.Mutex
	entries map[uint64]*notice
	order   []uint64 // arrival order, for eviction
	evicted map[uint64]bool
	descs   int
	waiters []chan struct{} // of the syncs waiting in take: add wakes each
	free    []*notice       // synced notices, reused: a steady stream allocates none
}

// maxFreeNotices bounds the synced entries kept for reuse (each keeps
// its buffers' room within maxKeptBuf).
const maxFreeNotices = 64

func newNoticeStore() *noticeStore {
	return &noticeStore{entries: map[uint64]*notice{}, evicted: map[uint64]bool{}}
}

var errNotice = errors.New("bad notice")

// add records one chunk; chunks of a transfer must come in order.
func (s *noticeStore) add(n wire.Notice, landed transport.Landed) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	mode := verify.Modes[n.Mode]
	e, ok := s.entries[n.ID]
	switch {
	case !ok && n.Base != 0:
		return fmt.Errorf("%w: transfer %#x: chunk at %d before its first", errNotice, n.ID, n.Base)
	case ok && (e.complete() || e.total != n.Total || e.mode != mode || n.Base != len(e.descs)):
		return fmt.Errorf("%w: transfer %#x: chunk at %d does not continue the notice", errNotice, n.ID, n.Base)
	}
	if !ok {
		e = s.newLocked()
		e.mode, e.total = mode, n.Total
		s.entries[n.ID] = e
		s.order = append(s.order, n.ID)
		delete(s.evicted, n.ID)
	}
	e.descs = append(e.descs, n.Descs...)
	if landed != nil {
		e.landed = append(e.landed, landed)
	}
	s.descs += len(n.Descs)
	for (len(s.entries) > maxNoticeEntries || s.descs > maxNoticeDescs) && len(s.order) > 1 {
		s.evictOldestLocked()
	}
	for _, w := range s.waiters {
		select {
		case w <- struct{}{}:
		default: // already woken
		}
	}
	return nil
}

// newLocked is a cleared entry, reused where one is free.
func (s *noticeStore) newLocked() *notice {
	if k := len(s.free); k > 0 {
		e := s.free[k-1]
		s.free = s.free[:k-1]
		return e
	}
	return &notice{}
}

// release gives back an entry that take returned, once its caller is done
// with it (its landed digests released).
func (s *noticeStore) release(e *notice) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.freeLocked(e)
}

// freeLocked clears e and keeps it for reuse, within maxFreeNotices.
func (s *noticeStore) freeLocked(e *notice) {
	clear(e.landed) // drop references
	*e = notice{descs: keep(e.descs), landed: keep(e.landed)}
	if len(s.free) < maxFreeNotices {
		s.free = append(s.free, e)
	}
}

// evictOldestLocked drops the oldest notice, releasing its landed
// digests (the landed index's lock nests inside the store's, never the
// other way) and keeping the entry for reuse: a receiver whose
// application never syncs allocates no more than one that does.
func (s *noticeStore) evictOldestLocked() {
	id := s.order[0]
	s.order = s.order[1:]
	if e, ok := s.entries[id]; ok {
		s.descs -= len(e.descs)
		delete(s.entries, id)
		if len(s.evicted) >= maxNoticeEntries {
			clear(s.evicted)
		}
		s.evicted[id] = true
		for _, l := range e.landed {
			l.Release()
		}
		s.freeLocked(e)
	}
}

// noticeWaiter is what a sync waits for notices with, made once per
// pooled syncCall: waiting then allocates nothing, where a same-host
// sender's notice is still on its way (it does not wait for its answer).
type noticeWaiter struct {
	wake  chan struct{} // buffered: add never blocks on it
	timer *time.Timer
}

func newNoticeWaiter() noticeWaiter {
	t := time.NewTimer(time.Hour)
	t.Stop()
	return noticeWaiter{wake: make(chan struct{}, 1), timer: t}
}

// take waits until the notice for id is complete and removes it; the
// caller gives it back with release. It gives up at deadline, or when
// closing is closed (the guard closes).
func (s *noticeStore) take(id uint64, w *noticeWaiter, deadline time.Time, closing <-chan struct{}) (*notice, error) {
	for {
		s.mu.Lock()
		if e, ok := s.entries[id]; ok && e.complete() {
			delete(s.entries, id)
			s.descs -= len(e.descs)
			for i, o := range s.order {
				if o == id {
					s.order = append(s.order[:i], s.order[i+1:]...)
					break
				}
			}
			s.mu.Unlock()
			return e, nil
		}
		if s.evicted[id] {
			s.mu.Unlock()
			return nil, fmt.Errorf("%w: the notice of transfer %#x was dropped: too many unsynced notices", ErrSession, id)
		}
		s.waiters = append(s.waiters, w.wake)
		s.mu.Unlock()
		w.timer.Reset(time.Until(deadline))
		var gaveUp bool
		select {
		case <-w.wake:
		case <-w.timer.C:
			gaveUp = true
		case <-closing:
			gaveUp = true
		}
		w.timer.Stop()
		s.mu.Lock()
		if i := slices.Index(s.waiters, w.wake); i >= 0 {
			s.waiters = slices.Delete(s.waiters, i, i+1)
		}
		s.mu.Unlock()
		select {
		case <-w.wake: // a wake after the select: the loop looks again anyway
		default:
		}
		if gaveUp {
			return nil, fmt.Errorf("%w: no complete notice for transfer %#x arrived", ErrTimeout, id)
		}
	}
}
