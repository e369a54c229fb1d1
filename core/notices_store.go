package core

import (
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/core/transport"
	"github.com/mcguard/mcguard/core/wire"
	"github.com/mcguard/mcguard/verify"
)

// Bounds of what peers' notices may hold in a receiver's memory: in all,
// and per sender, so that one sender whose notices are never synced (or
// that floods) drops its own oldest, not other senders'. Past a bound the
// oldest notices are dropped (a sync for one then says so); the notice
// being added is never dropped, however large.
const (
	maxNoticeEntries          = 1 << 16
	maxNoticeDescs            = 1 << 22
	maxNoticeEntriesPerSender = maxNoticeEntries / 4
	maxNoticeDescsPerSender   = maxNoticeDescs / 4
)

// notice is a transfer's completion notice as the receiver assembles it.
type notice struct {
	sender string // the session's sender id, from the handshake the notice proved
	mode   verify.Mode
	total  int
	descs  []wire.NoticeDesc
	landed []transport.Landed // per chunk that came with the digests taken as it landed
}

func (n *notice) complete() bool { return len(n.descs) == n.total }

// noticeStore holds the notices a receiving guard was sent until the
// application syncs them.
type noticeStore struct {
	mu        sync.Mutex
	entries   map[uint64]*notice
	order     []arrival // for eviction, oldest first
	evicted   map[uint64]bool
	contested map[uint64]bool // ids two senders sent notices for: a sync of one fails
	descs     int
	perSender map[string]noticeLoad // of the senders with entries
	waiters   []chan struct{}       // of the syncs waiting in take: add wakes each
	free      []*notice             // synced notices, reused: a steady stream allocates none
}

// arrival is a notice in arrival order.
type arrival struct {
	id     uint64
	sender string
}

// noticeLoad is what one sender's notices hold.
type noticeLoad struct{ entries, descs int }

// maxFreeNotices bounds the synced entries kept for reuse (each keeps
// its buffers' room within maxKeptBuf).
const maxFreeNotices = 64

func newNoticeStore() *noticeStore {
	return &noticeStore{entries: map[uint64]*notice{}, evicted: map[uint64]bool{}, contested: map[uint64]bool{}, perSender: map[string]noticeLoad{}}
}

var errNotice = errors.New("bad notice")

// add records one chunk, from sender; chunks of a transfer must come in
// order, from the sender that began it.
func (s *noticeStore) add(n wire.Notice, landed transport.Landed, sender string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	mode := verify.Modes[n.Mode]
	e, ok := s.entries[n.ID]
	switch {
	case s.contested[n.ID]:
		return fmt.Errorf("%w: transfer %#x: notices for it came from two senders", errNotice, n.ID)
	case ok && e.sender != sender:
		// Another sender's notice under an id a sender holds: one of them
		// is not the transfer's. Neither is believed, so that a sync of
		// the id fails rather than takes the one that came first.
		s.contestLocked(n.ID)
		return fmt.Errorf("%w: transfer %#x: another sender's notice holds this id; neither is kept", errNotice, n.ID)
	case !ok && n.Base != 0:
		return fmt.Errorf("%w: transfer %#x: chunk at %d before its first", errNotice, n.ID, n.Base)
	case ok && (e.complete() || e.total != n.Total || e.mode != mode || n.Base != len(e.descs)):
		return fmt.Errorf("%w: transfer %#x: chunk at %d does not continue the notice", errNotice, n.ID, n.Base)
	}
	if !ok {
		e = s.newLocked()
		e.sender, e.mode, e.total = sender, mode, n.Total
		s.entries[n.ID] = e
		s.order = append(s.order, arrival{n.ID, sender})
		delete(s.evicted, n.ID)
	}
	e.descs = append(e.descs, n.Descs...)
	if landed != nil {
		e.landed = append(e.landed, landed)
	}
	s.descs += len(n.Descs)
	load := s.perSender[sender]
	if !ok {
		load.entries++
	}
	load.descs += len(n.Descs)
	s.perSender[sender] = load
	for s.overLocked(sender) && s.evictOldestOfLocked(sender, n.ID) {
	}
	for len(s.entries) > maxNoticeEntries || s.descs > maxNoticeDescs {
		i := 0
		if s.order[0].id == n.ID { // a transfer's notice continued: older, but being added
			i = 1
		}
		if i >= len(s.order) {
			break
		}
		s.evictLocked(i)
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

// overLocked reports whether sender's notices are past its bounds.
func (s *noticeStore) overLocked(sender string) bool {
	load := s.perSender[sender]
	return load.entries > maxNoticeEntriesPerSender || load.descs > maxNoticeDescsPerSender
}

// evictOldestOfLocked drops sender's oldest notice other than keep's; false
// if it has none.
func (s *noticeStore) evictOldestOfLocked(sender string, keep uint64) bool {
	for i, a := range s.order {
		if a.sender == sender && a.id != keep {
			s.evictLocked(i)
			return true
		}
	}
	return false
}

// contestLocked drops id's notice and marks the id contested.
func (s *noticeStore) contestLocked(id uint64) {
	if i := slices.IndexFunc(s.order, func(a arrival) bool { return a.id == id }); i >= 0 {
		s.dropLocked(i)
	}
	if len(s.contested) >= maxNoticeEntries {
		clear(s.contested)
	}
	s.contested[id] = true
}

// evictLocked drops the notice at order[i], releasing its landed digests
// (the landed index's lock nests inside the store's, never the other
// way) and keeping the entry for reuse: a receiver whose application
// never syncs allocates no more than one that does.
func (s *noticeStore) evictLocked(i int) {
	id := s.dropLocked(i)
	if len(s.evicted) >= maxNoticeEntries {
		clear(s.evicted)
	}
	s.evicted[id] = true
}

// dropLocked forgets the notice at order[i] and returns its id.
func (s *noticeStore) dropLocked(i int) uint64 {
	id := s.order[i].id
	s.removeLocked(i)
	e := s.entries[id]
	delete(s.entries, id)
	for _, l := range e.landed {
		l.Release()
	}
	s.freeLocked(e)
	return id
}

// removeLocked takes order[i] out of the order and its notice out of
// the counts (the caller deletes the entry).
func (s *noticeStore) removeLocked(i int) {
	a := s.order[i]
	switch {
	case i == len(s.order)-1: // the newest, or the only one: its room is kept
		s.order = s.order[:i]
	case i == 0: // the oldest (a flood's evictions): nothing copied
		s.order = s.order[1:]
	default:
		s.order = append(s.order[:i], s.order[i+1:]...)
	}
	e := s.entries[a.id]
	s.descs -= len(e.descs)
	load := s.perSender[a.sender]
	load.entries--
	load.descs -= len(e.descs)
	if load.entries == 0 {
		delete(s.perSender, a.sender)
	} else {
		s.perSender[a.sender] = load
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
			for i, a := range s.order {
				if a.id == id {
					s.removeLocked(i)
					break
				}
			}
			delete(s.entries, id)
			s.mu.Unlock()
			return e, nil
		}
		if s.contested[id] {
			s.mu.Unlock()
			return nil, fmt.Errorf("%w: notices for transfer %#x came from two senders; neither is believed", errs.Session, id)
		}
		if s.evicted[id] {
			s.mu.Unlock()
			return nil, fmt.Errorf("%w: the notice of transfer %#x was dropped: too many unsynced notices, from its sender or in all", errs.Session, id)
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
			return nil, fmt.Errorf("%w: no complete notice for transfer %#x arrived", errs.Timeout, id)
		}
	}
}
