package transport

import (
	"context"
	"sync"

	"github.com/mcguard/mcguard/core/memory"
)

// Pending tracks the writes a target began or acknowledged but has not yet
// applied, so that a fence or a sync can wait for those that concern it.
type Pending struct {
	mu      sync.Mutex
	next    uint64
	writes  map[uint64]memory.Region
	waiters int           // Waits in progress: only they need to be woken
	changed chan struct{} // closed (and replaced) when a write lands and someone waits
}

// NewPending returns an empty tracker.
func NewPending() *Pending {
	return &Pending{writes: map[uint64]memory.Region{}, changed: make(chan struct{})}
}

// Add records a write into r and returns its id for Done.
func (h *Pending) Add(r memory.Region) uint64 {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.next++
	h.writes[h.next] = r
	return h.next
}

// Done records that write id landed, or never will.
func (h *Pending) Done(id uint64) {
	h.mu.Lock()
	defer h.mu.Unlock()
	delete(h.writes, id)
	if h.waiters > 0 {
		close(h.changed)
		h.changed = make(chan struct{})
	}
}

// Empty reports whether no write is pending: a waiter can skip its
// context and timer.
func (h *Pending) Empty() bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.writes) == 0
}

// Wait returns once no pending write overlaps any of ranges (any at all
// when ranges is nil), or with ctx's error.
func (h *Pending) Wait(ctx context.Context, ranges []memory.Region) error {
	h.mu.Lock()
	h.waiters++
	defer func() {
		h.mu.Lock()
		h.waiters--
		h.mu.Unlock()
	}()
	for {
		busy := false
		for _, w := range h.writes {
			if ranges == nil || overlapsAny(w, ranges) {
				busy = true
				break
			}
		}
		ch := h.changed
		h.mu.Unlock()
		if !busy {
			return nil
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return ctx.Err()
		}
		h.mu.Lock()
	}
}

func overlapsAny(w memory.Region, ranges []memory.Region) bool {
	for _, r := range ranges {
		if w.Overlaps(r) {
			return true
		}
	}
	return false
}
