package samehost

// Splitting a large same-host copy over threads: the kernel's cross-memory
// copy and memcpy into a mapping are each bound by one core's bandwidth.

import (
	"runtime"
	"sync"
)

// ParallelMin is the batch from which a push is split over several
// threads: the kernel pins the target's pages in every call, so one thread
// copies at about half of memcpy's speed, and the target's CPU takes no
// part. Below it a thread hand-off costs more than it saves.
const ParallelMin = 4 << 20

// Threads is how many goroutines a copy of total bytes is split over:
// one below ParallelMin, else GOMAXPROCS, at most 4.
func Threads(total uint64) int {
	if total < ParallelMin {
		return 1
	}
	return max(min(runtime.GOMAXPROCS(0), 4), 1)
}

// InRuns cuts pairs by bytes into contiguous runs of about total/k bytes
// (split gives a pair's first n bytes and the rest, where a run ends inside
// it), runs do on each run on a goroutine of its own, and returns the
// first error.
func InRuns[P any](pairs []P, total uint64, k int, size func(P) int, split func(P, int) (P, P), do func([]P) error) error {
	var wg sync.WaitGroup
	var mu sync.Mutex
	var first error
	share := int((total + uint64(k) - 1) / uint64(k))
	for len(pairs) > 0 {
		var run []P
		for need := share; need > 0 && len(pairs) > 0; {
			if n := size(pairs[0]); n <= need {
				run = append(run, pairs[0])
				pairs = pairs[1:]
				need -= n
				continue
			}
			head, tail := split(pairs[0], need)
			run = append(run, head)
			pairs[0] = tail
			need = 0
		}
		wg.Go(func() {
			if err := do(run); err != nil {
				mu.Lock()
				if first == nil {
					first = err
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	return first
}

// CopyPair is a memcpy of src into dst (the same length).
type CopyPair struct{ Dst, Src []byte }

// CopyPairs copies the pairs, on several goroutines where the batch is
// large (InRuns).
func CopyPairs(pairs []CopyPair, total uint64) {
	k := Threads(total)
	if k == 1 {
		for _, c := range pairs {
			copy(c.Dst, c.Src)
		}
		return
	}
	size := func(c CopyPair) int { return len(c.Src) }
	split := func(c CopyPair, n int) (CopyPair, CopyPair) {
		return CopyPair{Dst: c.Dst[:n], Src: c.Src[:n]}, CopyPair{Dst: c.Dst[n:], Src: c.Src[n:]}
	}
	InRuns(pairs, total, k, size, split, func(run []CopyPair) error {
		for _, c := range run {
			copy(c.Dst, c.Src)
		}
		return nil
	})
}
