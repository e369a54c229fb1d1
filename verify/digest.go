package verify

import (
	"fmt"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/zeebo/xxh3"
)

// DigestOf is the end-to-end checksum of digest mode: xxh3-64. It was
// measured against CRC32C (hash/crc32 with the Castagnoli table, SSE4.2)
// in BenchmarkDigest; xxh3 is faster here and its 64 bits make a chance
// match 2^32 times rarer (see BENCHMARKS.md).
func DigestOf(b []byte) uint64 { return xxh3.Hash(b) }

// Digester computes DigestOf over data written in pieces.
type Digester = *xxh3.Hasher

// NewDigester returns a Digester; its Sum64 equals DigestOf of all it was
// written.
func NewDigester() Digester { return xxh3.New() }

// CompareDigests is the receiver's half of digest mode: it digests each
// range with digest and compares it with want[i] (the sender's digest of
// its source), and returns an ErrMismatch error naming the ranges that
// differ, each called "what() i" (what is called only then). Large work
// is spread over the CPUs: the bytes just arrived from the network and
// are read from memory, not cache, so one core alone is bound by memory
// latency. Small work allocates nothing; digest escapes (the workers
// call it), so a caller that must not allocate binds it once.
func CompareDigests(ranges []Range, want []uint64, digest func(Range) (uint64, error), what func() string) error {
	var total uint64
	for _, r := range ranges {
		total += r.Len
	}
	var ok []bool // per range, where workers digested them
	if workers := min(runtime.GOMAXPROCS(0), len(ranges)); total >= 4<<20 && workers >= 2 {
		ok = digestSpread(ranges, want, digest, workers)
	}
	var bad []string
	for i, r := range ranges {
		var good bool
		if ok != nil {
			good = ok[i]
		} else {
			d, err := digest(r)
			good = err == nil && d == want[i]
		}
		if good {
			continue
		}
		if len(bad) < 16 {
			bad = append(bad, fmt.Sprintf("%s %d [%#x, +%d)", what(), i, r.Addr, r.Len))
		} else if len(bad) == 16 {
			bad = append(bad, "...")
		}
	}
	if bad != nil {
		return fmt.Errorf("%w: destination digests differ from the sender's: %s", ErrMismatch, strings.Join(bad, ", "))
	}
	return nil
}

// digestSpread compares every range's digest on workers goroutines.
func digestSpread(ranges []Range, want []uint64, digest func(Range) (uint64, error), workers int) []bool {
	ok := make([]bool, len(ranges))
	var next atomic.Int64
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		wg.Go(func() {
			for i := int(next.Add(1)) - 1; i < len(ranges); i = int(next.Add(1)) - 1 {
				d, err := digest(ranges[i])
				ok[i] = err == nil && d == want[i]
			}
		})
	}
	wg.Wait()
	return ok
}
