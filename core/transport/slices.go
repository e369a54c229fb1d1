package transport

import (
	"iter"
	"sync/atomic"

	"github.com/mcguard/mcguard/core/desc"
)

// MaxSlice is the most bytes one write or read-back request moves: larger
// descriptors are cut into slices of it, which bounds staging buffers,
// frames and memory-region spans alike.
const MaxSlice = 4 << 20

// Slice is one piece of descriptor Desc of a batch, or (Cursor) descriptors
// Desc to Desc+Joined that continue one another at both ends, whole.
type Slice struct {
	Desc          int // index into the descriptors sliced
	Joined        int // how many descriptors after Desc the slice takes in too
	Src, Dst, Len uint64
}

// CountJoined adds the descriptors sl took in after its first to n
// (joined_descriptors; nil: not counted).
func (sl Slice) CountJoined(n *atomic.Int64) {
	if sl.Joined > 0 && n != nil {
		n.Add(int64(sl.Joined))
	}
}

// Slices yields descs cut into slices of at most MaxSlice bytes, in order.
func Slices(descs []desc.Desc) iter.Seq[Slice] {
	return func(yield func(Slice) bool) {
		c := Cursor{Descs: descs}
		for sl, ok := c.Next(); ok; sl, ok = c.Next() {
			if !yield(sl) {
				return
			}
		}
	}
}

// Cursor walks a batch's slices in order: Slices', or with Reach set,
// runs of descriptors joined. A descriptor that starts where the one
// before it ended, at the source and at the destination, joins its slice,
// up to MaxSlice bytes: a batch of a cache's consecutive blocks then goes
// as a few large writes instead of one per block, as callers that group
// contiguous blocks themselves (vLLM's and SGLang's connectors) send it.
// A loop over Next allocates nothing (an iterator with a func in it did).
type Cursor struct {
	Descs []desc.Desc
	// Reach(src, dst) is how many bytes a run may span from src and dst
	// (to the ends of the registered regions holding them), asked only
	// where a descriptor could join: a run never crosses from one region
	// into another. nil: nothing is joined.
	Reach func(src, dst uint64) uint64
	// Max bounds a joined slice below MaxSlice (0: MaxSlice), as a
	// transport that spreads a batch over queue pairs needs.
	Max uint64
	// Whole leaves every descriptor whole however large (an engine cuts
	// its requests itself): only joined, never cut at MaxSlice.
	Whole bool
	i     int    // the descriptor Next starts at
	off   uint64 // how far into it
}

// Next returns the next slice, or false after the last.
func (c *Cursor) Next() (Slice, bool) {
	if c.i >= len(c.Descs) {
		return Slice{}, false
	}
	d := c.Descs[c.i]
	sl := Slice{Desc: c.i, Src: d.Src + c.off, Dst: d.Dst + c.off, Len: d.Len - c.off}
	if !c.Whole {
		sl.Len = min(MaxSlice, sl.Len)
	}
	whole := sl.Len == d.Len
	if c.off += sl.Len; c.off < d.Len {
		return sl, true
	}
	c.i, c.off = c.i+1, 0
	if c.Reach == nil || !whole { // a descriptor larger than a slice: cut, never joined
		return sl, true
	}
	most := uint64(MaxSlice)
	if c.Max > 0 {
		most = min(most, c.Max)
	}
	limit, asked := uint64(0), false
	for ; c.i < len(c.Descs); c.i++ {
		n := c.Descs[c.i]
		if n.Src != sl.Src+sl.Len || n.Dst != sl.Dst+sl.Len || sl.Len+n.Len > most {
			break
		}
		if !asked {
			limit, asked = c.Reach(sl.Src, sl.Dst), true
		}
		if sl.Len+n.Len > limit {
			break
		}
		sl.Len += n.Len
		sl.Joined++
	}
	return sl, true
}

// SliceRanges cuts ranges into ranges of at most MaxSlice bytes.
func SliceRanges(ranges []desc.Range, out []desc.Range) []desc.Range {
	for _, r := range ranges {
		for off := uint64(0); off < r.Len; off += MaxSlice {
			out = append(out, desc.Range{Addr: r.Addr + off, Len: min(MaxSlice, r.Len-off)})
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
