package verify

import (
	"fmt"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/mcguard/mcguard/core/desc"
)

// CompareDigests is the receiver's half of digest mode: it compares each
// range's digest with want[i] (the sender's digest of its source), and
// returns an ErrMismatch error naming the ranges that differ, each called
// "what() i" (what is called only then). A range's digest is known(r)
// where that has it (taken as the bytes landed), else digest(r), which
// reads the memory. known is asked once per range, in order, on this
// goroutine: a lookup, cheaper one after another than spread over
// goroutines that contend for the index's lock. Reads of 4 MiB or more
// are spread over the CPUs: the bytes just arrived from the network and
// are read from memory, not cache, so one core alone is bound by memory
// latency. Small work allocates nothing; digest escapes (the workers call
// it), so a caller that must not allocate binds it, and known, once.
func CompareDigests(ranges []desc.Range, want []uint64, known func(desc.Range) (uint64, bool), digest func(desc.Range) (uint64, error), what func() string) error {
	if known == nil {
		known = func(desc.Range) (uint64, bool) { return 0, false }
	}
	var bad []string
	differs := func(i int) {
		if len(bad) < 16 {
			bad = append(bad, fmt.Sprintf("%s %d [%#x, +%d)", what(), i, ranges[i].Addr, ranges[i].Len))
		} else if len(bad) == 16 {
			bad = append(bad, "...")
		}
	}
	var total uint64
	for _, r := range ranges {
		total += r.Len
	}
	workers := min(runtime.GOMAXPROCS(0), len(ranges))
	if total < 4<<20 || workers < 2 {
		for i, r := range ranges { // one pass: what is not known is read at once
			d, ok := known(r)
			var err error
			if !ok {
				d, err = digest(r)
			}
			if verdict(d, err, want[i]) == differing {
				differs(i)
			}
		}
	} else {
		// Known digests first, one after another; then the rest read,
		// spread where they are many bytes; then the verdicts in order.
		state := make([]digestState, len(ranges))
		var toRead uint64
		for i, r := range ranges {
			switch d, ok := known(r); {
			case !ok:
				state[i], toRead = unread, toRead+r.Len
			case d != want[i]:
				state[i] = differing
			}
		}
		if toRead >= 4<<20 {
			digestSpread(ranges, want, state, digest, workers)
		} else {
			for i, r := range ranges {
				if state[i] == unread {
					d, err := digest(r)
					state[i] = verdict(d, err, want[i])
				}
			}
		}
		for i, st := range state {
			if st == differing {
				differs(i)
			}
		}
	}
	if bad != nil {
		return fmt.Errorf("%w: destination digests differ from the sender's: %s", ErrMismatch, strings.Join(bad, ", "))
	}
	return nil
}

// digestState is a range's verdict in CompareDigests' large path.
type digestState uint8

const (
	matching digestState = iota
	unread               // its digest is not known: read it
	differing
)

// verdict is the state of a range whose digest read gave d and err: a
// failed read differs.
func verdict(d uint64, err error, want uint64) digestState {
	if err != nil || d != want {
		return differing
	}
	return matching
}

// digestSpread reads and compares, on workers goroutines, the ranges
// whose state is unread, leaving each its verdict.
func digestSpread(ranges []desc.Range, want []uint64, state []digestState, digest func(desc.Range) (uint64, error), workers int) {
	var next atomic.Int64
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		wg.Go(func() {
			for i := int(next.Add(1)) - 1; i < len(ranges); i = int(next.Add(1)) - 1 {
				if state[i] == unread {
					d, err := digest(ranges[i])
					state[i] = verdict(d, err, want[i])
				}
			}
		})
	}
	wg.Wait()
}
