// Package notices is a receiving guard's store of completion notices:
// what its peers announced, held until the application syncs it, bounded
// per sender and in all.
package notices

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/core/reuse"
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

// Notice is a transfer's completion notice as the receiver assembles it.
type Notice struct {
	Sender string // the session's sender id, from the handshake the notice proved
	Mode   verify.Mode
	Total  int
	Descs  []wire.NoticeDesc
	Landed []transport.Landed // per chunk that came with the digests taken as it landed
}

// Complete says every chunk of the notice arrived.
func (n *Notice) Complete() bool { return len(n.Descs) == n.Total }

// Store holds the notices a receiving guard was sent until the
// application syncs them.
type Store struct {
	mu        sync.Mutex
	entries   map[uint64]*Notice
	order     []arrival // for eviction, oldest first
	evicted   map[uint64]bool
	contested map[uint64]bool // ids two senders sent notices for: a sync of one fails
	descs     int
	perSender map[string]Load // of the senders with entries
	waiters   []chan struct{} // of the syncs waiting in take: add wakes each
	free      []*Notice       // synced notices, reused: a steady stream allocates none
}

// arrival is a notice in arrival order.
type arrival struct {
	id     uint64
	sender string
}

// Load is what one sender's notices hold.
type Load struct{ Entries, Descs int }

// maxFreeNotices bounds the synced entries kept for reuse (each keeps
// its buffers' room within reuse.MaxKept).
const maxFreeNotices = 64

func NewStore() *Store {
	return &Store{entries: map[uint64]*Notice{}, evicted: map[uint64]bool{}, contested: map[uint64]bool{}, perSender: map[string]Load{}}
}

// ErrNotice marks a notice refused as malformed or out of turn.
var ErrNotice = errors.New("bad notice")

// Add records one chunk, from sender; chunks of a transfer must come in
// order, from the sender that began it.
func (s *Store) Add(n wire.Notice, landed transport.Landed, sender string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	mode := verify.Modes[n.Mode]
	e, ok := s.entries[n.ID]
	switch {
	case s.contested[n.ID]:
		return fmt.Errorf("%w: transfer %#x: notices for it came from two senders", ErrNotice, n.ID)
	case ok && e.Sender != sender:
		// Another sender's notice under an id a sender holds: one of them
		// is not the transfer's. Neither is believed, so that a sync of
		// the id fails rather than takes the one that came first.
		s.contestLocked(n.ID)
		return fmt.Errorf("%w: transfer %#x: another sender's notice holds this id; neither is kept", ErrNotice, n.ID)
	case !ok && n.Base != 0:
		return fmt.Errorf("%w: transfer %#x: chunk at %d before its first", ErrNotice, n.ID, n.Base)
	case ok && (e.Complete() || e.Total != n.Total || e.Mode != mode || n.Base != len(e.Descs)):
		return fmt.Errorf("%w: transfer %#x: chunk at %d does not continue the notice", ErrNotice, n.ID, n.Base)
	}
	if !ok {
		e = s.newLocked()
		e.Sender, e.Mode, e.Total = sender, mode, n.Total
		s.entries[n.ID] = e
		s.order = append(s.order, arrival{n.ID, sender})
		delete(s.evicted, n.ID)
	}
	e.Descs = append(e.Descs, n.Descs...)
	if landed != nil {
		e.Landed = append(e.Landed, landed)
	}
	s.descs += len(n.Descs)
	load := s.perSender[sender]
	if !ok {
		load.Entries++
	}
	load.Descs += len(n.Descs)
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
func (s *Store) newLocked() *Notice {
	if k := len(s.free); k > 0 {
		e := s.free[k-1]
		s.free = s.free[:k-1]
		return e
	}
	return &Notice{}
}

// Release gives back an entry that Take returned, once its caller is done
// with it (its landed digests released).
func (s *Store) Release(e *Notice) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.freeLocked(e)
}

// freeLocked clears e and keeps it for reuse, within maxFreeNotices.
func (s *Store) freeLocked(e *Notice) {
	clear(e.Landed) // drop references
	*e = Notice{Descs: reuse.Keep(e.Descs), Landed: reuse.Keep(e.Landed)}
	if len(s.free) < maxFreeNotices {
		s.free = append(s.free, e)
	}
}

// overLocked reports whether sender's notices are past its bounds.
func (s *Store) overLocked(sender string) bool {
	load := s.perSender[sender]
	return load.Entries > maxNoticeEntriesPerSender || load.Descs > maxNoticeDescsPerSender
}

// evictOldestOfLocked drops sender's oldest notice other than keep's; false
// if it has none.
func (s *Store) evictOldestOfLocked(sender string, keep uint64) bool {
	for i, a := range s.order {
		if a.sender == sender && a.id != keep {
			s.evictLocked(i)
			return true
		}
	}
	return false
}

// contestLocked drops id's notice and marks the id contested.
func (s *Store) contestLocked(id uint64) {
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
func (s *Store) evictLocked(i int) {
	id := s.dropLocked(i)
	if len(s.evicted) >= maxNoticeEntries {
		clear(s.evicted)
	}
	s.evicted[id] = true
}

// dropLocked forgets the notice at order[i] and returns its id.
func (s *Store) dropLocked(i int) uint64 {
	id := s.order[i].id
	s.removeLocked(i)
	e := s.entries[id]
	delete(s.entries, id)
	for _, l := range e.Landed {
		l.Release()
	}
	s.freeLocked(e)
	return id
}

// removeLocked takes order[i] out of the order and its notice out of
// the counts (the caller deletes the entry).
func (s *Store) removeLocked(i int) {
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
	s.descs -= len(e.Descs)
	load := s.perSender[a.sender]
	load.Entries--
	load.Descs -= len(e.Descs)
	if load.Entries == 0 {
		delete(s.perSender, a.sender)
	} else {
		s.perSender[a.sender] = load
	}
}

// Waiter is what a sync waits for notices with, made once per
// pooled syncCall: waiting then allocates nothing, where a same-host
// sender's notice is still on its way (it does not wait for its answer).
type Waiter struct {
	wake  chan struct{} // buffered: add never blocks on it
	timer *time.Timer
}

// NewWaiter makes a Waiter.
func NewWaiter() Waiter {
	t := time.NewTimer(time.Hour)
	t.Stop()
	return Waiter{wake: make(chan struct{}, 1), timer: t}
}

// Take waits until the notice for id is complete and removes it; the
// caller gives it back with Release. It gives up at deadline, or when
// closing is closed (the guard closes). poll (nil: none) takes notices
// that come without waking anyone (a same-host sender's notice ring):
// Take calls it when the notice is not here, then, while poll says such
// notices can come, again at intervals growing from pollFirst to
// pollLast while it waits.
func (s *Store) Take(id uint64, w *Waiter, deadline time.Time, closing <-chan struct{}, poll func() bool) (*Notice, error) {
	var pause time.Duration // 0: not polled yet
	for {
		s.mu.Lock()
		if e, ok := s.entries[id]; ok && e.Complete() {
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
		if poll != nil && pause == 0 { // the common same-host case: it is in a ring
			s.mu.Unlock()
			if !poll() {
				poll = nil
			}
			pause = pollFirst
			continue
		}
		s.waiters = append(s.waiters, w.wake)
		s.mu.Unlock()
		wait := time.Until(deadline)
		polling := poll != nil && wait > pause
		if polling {
			wait = pause
		}
		w.timer.Reset(wait)
		var gaveUp bool
		select {
		case <-w.wake:
		case <-w.timer.C:
			gaveUp = !polling
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
		if polling {
			poll()
			pause = min(2*pause, pollLast)
		}
	}
}

// pollFirst and pollLast bound the intervals at which a waiting Take
// polls: a notice put in a ring while a sync waits is taken within about
// twice its age, and an idle wait costs a poll a millisecond.
const (
	pollFirst = 20 * time.Microsecond
	pollLast  = time.Millisecond
)

// Loads is what each sender's unsynced notices hold now (a copy).
func (s *Store) Loads() map[string]Load {
	s.mu.Lock()
	defer s.mu.Unlock()
	return maps.Clone(s.perSender)
}

// Kept counts the synced entries kept for reuse.
func (s *Store) Kept() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.free)
}
