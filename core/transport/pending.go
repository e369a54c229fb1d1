package transport

import (
	"context"
	"sync"

	"github.com/mcguard/mcguard/core/memory"
)

// Pending tracks the writes a target began or acknowledged but has not yet
// applied, so that a fence or a sync can wait for those that concern it.
// Every write the TCP target applies passes through it, so a write takes
// a slot of a slice, freed slots reused, rather than a map entry: no
// hashing, and no allocation once the slots in use have been reached.
type Pending struct {
	mu      sync.Mutex
	writes  []pendingWrite
	free    []int         // slots of writes not in use
	live    int           // slots in use
	waiters int           // Waits in progress: only they need to be woken
	changed chan struct{} // closed (and replaced) when a write lands and someone waits
}

type pendingWrite struct {
	r    memory.Region
	live bool
}

// NewPending returns an empty tracker.
func NewPending() *Pending {
	return &Pending{changed: make(chan struct{})}
}

// Add records a write into r and returns its id for Done.
func (h *Pending) Add(r memory.Region) uint64 {
	h.mu.Lock()
	defer h.mu.Unlock()
	var k int
	if n := len(h.free); n > 0 {
		k, h.free = h.free[n-1], h.free[:n-1]
	} else {
		k = len(h.writes)
		h.writes = append(h.writes, pendingWrite{})
	}
	h.writes[k] = pendingWrite{r: r, live: true}
	h.live++
	return uint64(k) + 1 // never 0: callers keep 0 for "none"
}

// Done records that write id landed, or never will. Each id is done
// once: its slot is then another write's.
func (h *Pending) Done(id uint64) {
	h.mu.Lock()
	defer h.mu.Unlock()
	k := id - 1
	if id == 0 || k >= uint64(len(h.writes)) || !h.writes[k].live {
		return
	}
	h.writes[k].live = false
	h.free = append(h.free, int(k))
	h.live--
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
	return h.live == 0
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
			if w.live && (ranges == nil || overlapsAny(w.r, ranges)) {
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
