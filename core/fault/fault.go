// Package fault is fault injection at a target: each mode reproduces, on
// one machine, a way in which a transport's "complete" is not "delivered".
// It is off unless a test, the demo or the stress tool turns it on, and
// loudly logged when on.
package fault

import (
	"bytes"
	"math/rand"
	"sync"
	"time"

	"github.com/mcguard/mcguard/core/logs"
)

// The modes.
const (
	None = "none"
	// Lag acknowledges a write at once and applies it up to LagMax
	// later: a posted write. A fence on the same connection waits for it
	// (as an RDMA READ flushes earlier writes on its QP).
	Lag = "lag"
	// Drop never applies a Rate fraction of writes.
	Drop = "drop"
	// Tear applies only a random prefix of a Rate fraction of writes.
	Tear = "tear"
	// Reorder applies every write whole but after a random delay, so
	// writes land out of order; a fence does not wait for them (they stand
	// for another rail or QP, which a fence on this one does not flush).
	Reorder = "reorder"
	// Stale loses a Rate fraction of the writes whose last tail bytes
	// already equal the destination's: the blind spot of a tail check.
	Stale = "stale"
	// Hold delivers a Rate fraction of writes LagMax late, as a slow or
	// partitioned path does, holding up the connection's later frames and
	// acknowledging them only once applied: a sender gives up, and the
	// bytes arrive after it did (the abort hole).
	Hold = "hold"
	// Lie, over an engine only, never hands a Rate fraction of writes to
	// the engine and answers later reads of their ranges from a copy of
	// their bytes: an engine whose read path is not the receiver's memory.
	// Every read-back trusts that path; only a check at the receiver
	// (digest, with the receiver's sync) sees through it.
	Lie = "lie"
)

// Modes lists the fault modes, none first.
var Modes = []string{None, Lag, Drop, Tear, Reorder, Stale, Hold, Lie}

// Delivery lists the modes in which a target does not deliver what it
// acknowledges: what verification must catch (the detection matrix).
// Hold acknowledges only what it applied; it makes the abort race.
var Delivery = []string{Lag, Drop, Tear, Reorder, Stale}

// Config turns fault injection on.
type Config struct {
	Mode   string        // one of Modes
	Rate   float64       // drop, tear, stale: the fraction of writes hit
	LagMax time.Duration // lag, reorder: the longest delay before a write lands
	Seed   int
}

// Injector decides the fate of each write under one fault mode.
type Injector struct {
	mode      string
	rate      float64
	lagMax    time.Duration
	tailBytes int

	mu  sync.Mutex
	rng *rand.Rand
}

// New returns the injector f asks for, or nil for none. tailBytes is the
// tail check's length (stale hits writes whose tail already matches);
// where names the target in the warning.
func New(f Config, tailBytes int, where string) *Injector {
	if f.Mode == None || f.Mode == "" {
		return nil
	}
	logs.Printf(logs.Warn, "FAULT INJECTION ON at %s: %s (rate %g, delays up to %v) — this target does not deliver what it acknowledges", where, f.Mode, f.Rate, f.LagMax)
	return &Injector{mode: f.Mode, rate: f.Rate, lagMax: f.LagMax, tailBytes: tailBytes, rng: rand.New(rand.NewSource(int64(f.Seed)))}
}

func (f *Injector) hit() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.rng.Float64() < f.rate
}

// Delay draws how long a held write waits: LagMax for hold, up to it for
// the others.
func (f *Injector) Delay() time.Duration {
	if f.mode == Hold {
		return f.lagMax
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	return time.Duration(f.rng.Int63n(int64(f.lagMax) + 1))
}

func (f *Injector) prefix(n uint64) uint64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	return uint64(f.rng.Int63n(int64(n)))
}

// Lies reports whether this write is one a lying engine keeps to itself.
func (f *Injector) Lies() bool { return f != nil && f.mode == Lie && f.hit() }

// Holds reports whether the mode keeps writes back to apply them later.
func (f *Injector) Holds() bool { return f != nil && (f.mode == Lag || f.mode == Reorder) }

// Fate is what happens to one write: the bytes of payload to apply now
// (a prefix, all, or none) and whether the write is held for later.
// dstTail is the destination's current last tailBytes (stale only).
func (f *Injector) Fate(payload, dstTail []byte) (now []byte, hold bool) {
	if f.mode == Stale {
		k := min(f.tailBytes, len(payload))
		if bytes.Equal(payload[len(payload)-k:], dstTail) && f.hit() {
			return nil, false
		}
		return payload, false
	}
	n, hold := f.Cut(uint64(len(payload)))
	return payload[:n], hold
}

// Cut is the fate of a write known only by its length n, as where writes
// are handed to an engine: how many of its leading bytes are written now,
// and whether it is held for later. Stale needs the bytes; Cut writes
// every byte under it.
func (f *Injector) Cut(n uint64) (now uint64, hold bool) {
	switch f.mode {
	case Lag, Reorder:
		return 0, true
	case Hold:
		if f.hit() {
			return 0, true
		}
	case Drop:
		if f.hit() {
			return 0, false
		}
	case Tear:
		if f.hit() {
			return f.prefix(n), false
		}
	}
	return n, false
}

// Mode is the injector's mode (None for no injector).
func (f *Injector) Mode() string {
	if f == nil {
		return None
	}
	return f.mode
}

// TailBytes is how many last bytes Fate's dstTail must hold (stale).
func (f *Injector) TailBytes() int { return f.tailBytes }
