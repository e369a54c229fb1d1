package core

import (
	"bytes"
	"context"
	"log"
	"math/rand"
	"sync"
	"time"
)

// Fault injection modes of a target. Each reproduces, on one machine, a
// way in which a transport's "complete" is not "delivered".
const (
	FaultNone = "none"
	// FaultLag acknowledges a write at once and applies it up to LagMax
	// later: a posted write. A fence on the same connection waits for it
	// (as an RDMA READ flushes earlier writes on its QP).
	FaultLag = "lag"
	// FaultDrop never applies a Rate fraction of writes.
	FaultDrop = "drop"
	// FaultTear applies only a random prefix of a Rate fraction of writes.
	FaultTear = "tear"
	// FaultReorder applies every write whole but after a random delay, so
	// writes land out of order; a fence does not wait for them (they stand
	// for another rail or QP, which a fence on this one does not flush).
	FaultReorder = "reorder"
	// FaultStale loses a Rate fraction of the writes whose last tail bytes
	// already equal the destination's: the blind spot of a tail check.
	FaultStale = "stale"
)

// FaultModes lists the fault modes, none first.
var FaultModes = []string{FaultNone, FaultLag, FaultDrop, FaultTear, FaultReorder, FaultStale}

// faults decides the fate of each write under one fault mode.
type faults struct {
	mode      string
	rate      float64
	lagMax    time.Duration
	tailBytes int

	mu  sync.Mutex
	rng *rand.Rand
}

func newFaults(f FaultConfig, tailBytes int, where string) *faults {
	if f.Mode == FaultNone || f.Mode == "" {
		return nil
	}
	log.Printf("mcguard: WARNING: FAULT INJECTION ON at %s: %s (rate %g, delays up to %v) — this target does not deliver what it acknowledges", where, f.Mode, f.Rate, f.LagMax)
	return &faults{mode: f.Mode, rate: f.Rate, lagMax: f.LagMax, tailBytes: tailBytes, rng: rand.New(rand.NewSource(int64(f.Seed)))}
}

func (f *faults) hit() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.rng.Float64() < f.rate
}

func (f *faults) delay() time.Duration {
	f.mu.Lock()
	defer f.mu.Unlock()
	return time.Duration(f.rng.Int63n(int64(f.lagMax) + 1))
}

func (f *faults) prefix(n uint64) uint64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	return uint64(f.rng.Int63n(int64(n)))
}

// holds reports whether the mode keeps writes back to apply them later.
func (f *faults) holds() bool { return f != nil && (f.mode == FaultLag || f.mode == FaultReorder) }

// fate is what happens to one write: the bytes of payload to apply now
// (a prefix, all, or none) and whether the write is held for later.
// dstTail is the destination's current last tailBytes (stale only).
func (f *faults) fate(payload, dstTail []byte) (now []byte, hold bool) {
	switch f.mode {
	case FaultLag, FaultReorder:
		return nil, true
	case FaultDrop:
		if f.hit() {
			return nil, false
		}
	case FaultTear:
		if f.hit() {
			return payload[:f.prefix(uint64(len(payload)))], false
		}
	case FaultStale:
		k := min(f.tailBytes, len(payload))
		if bytes.Equal(payload[len(payload)-k:], dstTail) && f.hit() {
			return nil, false
		}
	}
	return payload, false
}

// heldWrites tracks writes acknowledged but not yet applied, so a fence
// or a sync can wait for those that concern it.
type heldWrites struct {
	mu      sync.Mutex
	next    uint64
	writes  map[uint64]Region
	changed chan struct{} // closed (and replaced) whenever one lands
}

func newHeldWrites() *heldWrites {
	return &heldWrites{writes: map[uint64]Region{}, changed: make(chan struct{})}
}

func (h *heldWrites) add(r Region) uint64 {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.next++
	h.writes[h.next] = r
	return h.next
}

func (h *heldWrites) done(id uint64) {
	h.mu.Lock()
	defer h.mu.Unlock()
	delete(h.writes, id)
	close(h.changed)
	h.changed = make(chan struct{})
}

// wait returns once no held write overlaps any of ranges (all of them when
// ranges is nil), or with ctx's error.
func (h *heldWrites) wait(ctx context.Context, ranges []Region) error {
	for {
		h.mu.Lock()
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
	}
}

func overlapsAny(w Region, ranges []Region) bool {
	for _, r := range ranges {
		if w.Addr < r.end() && r.Addr < w.end() {
			return true
		}
	}
	return false
}
