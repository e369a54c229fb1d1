package transport

import (
	"iter"

	"github.com/mcguard/mcguard/verify"
)

// MaxSlice is the most bytes one write or read-back request moves: larger
// descriptors are cut into slices of it, which bounds staging buffers,
// frames and memory-region spans alike.
const MaxSlice = 4 << 20

// Slice is one piece of descriptor Desc of a batch.
type Slice struct {
	Desc          int // index into the descriptors sliced
	Src, Dst, Len uint64
}

// Slices yields descs cut into slices of at most MaxSlice bytes, in order.
func Slices(descs []verify.Desc) iter.Seq[Slice] {
	return func(yield func(Slice) bool) {
		for i, d := range descs {
			for off := uint64(0); off < d.Len; off += MaxSlice {
				if !yield(Slice{Desc: i, Src: d.Src + off, Dst: d.Dst + off, Len: min(MaxSlice, d.Len-off)}) {
					return
				}
			}
		}
	}
}

// SliceRanges cuts ranges into ranges of at most MaxSlice bytes.
func SliceRanges(ranges []verify.Range, out []verify.Range) []verify.Range {
	for _, r := range ranges {
		for off := uint64(0); off < r.Len; off += MaxSlice {
			out = append(out, verify.Range{Addr: r.Addr + off, Len: min(MaxSlice, r.Len-off)})
		}
	}
	return out
}

// Groups yields the runs [start, end) that cover items 0..n-1 in order,
// each of at most maxCount items and maxBytes bytes (size(i) is item i's),
// and each of at least one item, however large.
func Groups(n int, size func(i int) uint64, maxCount int, maxBytes uint64) iter.Seq2[int, int] {
	return func(yield func(int, int) bool) {
		for start := 0; start < n; {
			end, total := start, uint64(0)
			for end < n && end-start < maxCount && (end == start || total+size(end) <= maxBytes) {
				total += size(end)
				end++
			}
			if !yield(start, end) {
				return
			}
			start = end
		}
	}
}
