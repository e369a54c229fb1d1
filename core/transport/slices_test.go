package transport

import (
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/core/desc"
)

// walk returns every slice a cursor over descs yields, and how often it
// asked reach.
func walk(descs []desc.Desc, reach func(src, dst uint64) uint64) (out []Slice, asked int) {
	c := Cursor{Descs: descs}
	if reach != nil {
		c.Reach = func(src, dst uint64) uint64 { asked++; return reach(src, dst) }
	}
	for sl, ok := c.Next(); ok; sl, ok = c.Next() {
		out = append(out, sl)
	}
	return out, asked
}

// blocks is n descriptors of size bytes, consecutive at both ends.
func blocks(n int, size uint64) []desc.Desc {
	d := make([]desc.Desc, n)
	for i := range d {
		d[i] = desc.Desc{Src: 1 << 40, Dst: 1 << 41, Len: size}
		d[i].Src += uint64(i) * size
		d[i].Dst += uint64(i) * size
	}
	return d
}

func far(uint64, uint64) uint64 { return 1 << 50 }

func TestCursorWithoutReachCutsOnly(t *testing.T) {
	descs := append(blocks(3, 4096), desc.Desc{Src: 1 << 42, Dst: 1 << 43, Len: MaxSlice + 10})
	got, _ := walk(descs, nil)
	require.Equal(t, []Slice{
		{Desc: 0, Src: descs[0].Src, Dst: descs[0].Dst, Len: 4096},
		{Desc: 1, Src: descs[1].Src, Dst: descs[1].Dst, Len: 4096},
		{Desc: 2, Src: descs[2].Src, Dst: descs[2].Dst, Len: 4096},
		{Desc: 3, Src: 1 << 42, Dst: 1 << 43, Len: MaxSlice},
		{Desc: 3, Src: 1<<42 + MaxSlice, Dst: 1<<43 + MaxSlice, Len: 10},
	}, got)
	var viaSlices []Slice
	for sl := range Slices(descs) {
		viaSlices = append(viaSlices, sl)
	}
	require.Equal(t, got, viaSlices, "Slices is the cursor without reach")
}

// Whole (an engine's requests): a descriptor of any size goes as it is,
// and small ones that continue it are joined up to Max.
func TestCursorWholeNeverCuts(t *testing.T) {
	big := desc.Desc{Src: 1 << 42, Dst: 1 << 43, Len: 3*MaxSlice + 10}
	descs := append([]desc.Desc{big}, blocks(20, 4096)...)
	c := Cursor{Descs: descs, Reach: far, Max: 64 << 10, Whole: true}
	var got []Slice
	for sl, ok := c.Next(); ok; sl, ok = c.Next() {
		got = append(got, sl)
	}
	require.Equal(t, []Slice{
		{Desc: 0, Src: big.Src, Dst: big.Dst, Len: big.Len},
		{Desc: 1, Joined: 15, Src: descs[1].Src, Dst: descs[1].Dst, Len: 64 << 10},
		{Desc: 17, Joined: 3, Src: descs[17].Src, Dst: descs[17].Dst, Len: 16 << 10},
	}, got)
}

func TestCursorJoinsConsecutiveBlocks(t *testing.T) {
	// 4096 blocks of 4 KiB, as a cache's consecutive blocks: 16 MiB in
	// four writes of MaxSlice, one reach asked per write.
	got, asked := walk(blocks(4096, 4096), far)
	require.Len(t, got, 4)
	for i, sl := range got {
		require.Equal(t, Slice{Desc: i * 1024, Joined: 1023, Src: 1<<40 + uint64(i)*MaxSlice, Dst: 1<<41 + uint64(i)*MaxSlice, Len: MaxSlice}, sl)
	}
	require.Equal(t, 4, asked)
}

func TestCursorJoinsOnlyWhatContinuesAtBothEnds(t *testing.T) {
	d := blocks(6, 100)
	d[2].Dst++    // 2 does not continue 1 at the destination, nor 3 continue 2
	d[4].Src += 7 // 4 does not continue 3 at the source, nor 5 continue 4
	got, _ := walk(d, far)
	require.Equal(t, []Slice{
		{Desc: 0, Joined: 1, Src: d[0].Src, Dst: d[0].Dst, Len: 200},
		{Desc: 2, Src: d[2].Src, Dst: d[2].Dst, Len: 100},
		{Desc: 3, Src: d[3].Src, Dst: d[3].Dst, Len: 100},
		{Desc: 4, Src: d[4].Src, Dst: d[4].Dst, Len: 100},
		{Desc: 5, Src: d[5].Src, Dst: d[5].Dst, Len: 100},
	}, got)

	// Scattered blocks (every other one, or backwards) never ask reach.
	back := blocks(8, 4096)
	for i, j := 0, len(back)-1; i < j; i, j = i+1, j-1 {
		back[i].Dst, back[j].Dst = back[j].Dst, back[i].Dst
	}
	got, asked := walk(back, far)
	require.Len(t, got, 8)
	require.Zero(t, asked)
}

func TestCursorStaysInsideRegionsAndSlices(t *testing.T) {
	// Regions end 3 blocks from the first one's source and 5 from its
	// destination: a run stops at the nearer end and starts afresh.
	d := blocks(8, 1024)
	ends := func(src, dst uint64) uint64 {
		srcEnd, dstEnd := d[0].Src+3*1024, d[0].Dst+5*1024
		if src >= srcEnd {
			srcEnd = 1 << 50
		}
		if dst >= dstEnd {
			dstEnd = 1 << 50
		}
		return min(srcEnd-src, dstEnd-dst)
	}
	got, _ := walk(d, ends)
	require.Equal(t, []Slice{
		{Desc: 0, Joined: 2, Src: d[0].Src, Dst: d[0].Dst, Len: 3 * 1024},
		{Desc: 3, Joined: 1, Src: d[3].Src, Dst: d[3].Dst, Len: 2 * 1024},
		{Desc: 5, Joined: 2, Src: d[5].Src, Dst: d[5].Dst, Len: 3 * 1024},
	}, got)

	// Nothing joins across an unknown region (reach 0), nor a block
	// larger than a slice, nor past MaxSlice.
	got, _ = walk(blocks(3, 64), func(uint64, uint64) uint64 { return 0 })
	require.Len(t, got, 3)
	big := blocks(3, MaxSlice/2+1)
	got, _ = walk(big, far)
	require.Len(t, got, 3, "two halves and a byte more do not fit one slice")
	mixed := blocks(2, 4096)
	mixed = append(mixed, desc.Desc{Src: mixed[1].Src + 4096, Dst: mixed[1].Dst + 4096, Len: MaxSlice + 1})
	got, _ = walk(mixed, far)
	require.Equal(t, []Slice{
		{Desc: 0, Joined: 1, Src: mixed[0].Src, Dst: mixed[0].Dst, Len: 8192},
		{Desc: 2, Src: mixed[2].Src, Dst: mixed[2].Dst, Len: MaxSlice},
		{Desc: 2, Src: mixed[2].Src + MaxSlice, Dst: mixed[2].Dst + MaxSlice, Len: 1},
	}, got, "a large descriptor is cut as always, never joined")
	after := []desc.Desc{{Src: 1 << 40, Dst: 1 << 41, Len: MaxSlice + 1}, {Src: 1<<40 + MaxSlice + 1, Dst: 1<<41 + MaxSlice + 1, Len: 64}}
	got, _ = walk(after, far)
	require.Len(t, got, 3, "nor is the piece it ends with joined to the block after it")

	// Max bounds a joined slice (a queue pair's share).
	c := Cursor{Descs: blocks(8, 4096), Reach: far, Max: 3 * 4096}
	var lens []uint64
	for sl, ok := c.Next(); ok; sl, ok = c.Next() {
		lens = append(lens, sl.Len)
	}
	require.Equal(t, []uint64{3 * 4096, 3 * 4096, 2 * 4096}, lens)
}

// Random batches (sizes around a slice, gaps or none, region ends at
// random): the cursor's slices cover every descriptor's bytes exactly
// once, in order; a joined slice is whole descriptors that continue one
// another; none is longer than MaxSlice or crosses a region end.
func TestCursorPropertiesOnRandomBatches(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 11))
	sizes := []uint64{1, 64, 4096, MaxSlice / 3, MaxSlice - 1, MaxSlice, MaxSlice + 1}
	for round := 0; round < 2000; round++ {
		n := 1 + r.IntN(40)
		descs := make([]desc.Desc, n)
		src, dst := uint64(1<<40), uint64(1<<41)
		for i := range descs {
			if r.IntN(3) == 0 { // a gap at one end or the other
				src += uint64(r.IntN(2)) * 4096
				dst += uint64(r.IntN(2)) * 4096
			}
			descs[i] = desc.Desc{Src: src, Dst: dst, Len: sizes[r.IntN(len(sizes))]}
			src += descs[i].Len
			dst += descs[i].Len
		}
		srcEnd, dstEnd := uint64(1<<40)+r.Uint64N(src-1<<40+1), uint64(1<<41)+r.Uint64N(dst-1<<41+1)
		reach := func(s, d uint64) uint64 { // two regions at each end, cut at srcEnd and dstEnd
			far := func(a, end uint64) uint64 {
				if a < end {
					return end - a
				}
				return 1 << 50
			}
			return min(far(s, srcEnd), far(d, dstEnd))
		}
		got, _ := walk(descs, reach)
		next, off := 0, uint64(0) // where the next slice must start
		for _, sl := range got {
			require.Equal(t, next, sl.Desc)
			d := descs[sl.Desc]
			require.Equal(t, d.Src+off, sl.Src)
			require.Equal(t, d.Dst+off, sl.Dst)
			require.LessOrEqual(t, sl.Len, uint64(MaxSlice))
			if sl.Joined > 0 {
				require.Zero(t, off, "a joined slice starts a descriptor")
				var sum uint64
				for k := sl.Desc; k <= sl.Desc+sl.Joined; k++ {
					if k > sl.Desc {
						require.Equal(t, descs[k-1].Src+descs[k-1].Len, descs[k].Src)
						require.Equal(t, descs[k-1].Dst+descs[k-1].Len, descs[k].Dst)
					}
					sum += descs[k].Len
				}
				require.Equal(t, sum, sl.Len, "whole descriptors")
				require.False(t, sl.Src < srcEnd && sl.Src+sl.Len > srcEnd, "inside one source region")
				require.False(t, sl.Dst < dstEnd && sl.Dst+sl.Len > dstEnd, "inside one destination region")
				next, off = sl.Desc+sl.Joined+1, 0
				continue
			}
			if off += sl.Len; off == d.Len {
				next, off = next+1, 0
			}
		}
		require.Equal(t, n, next, "every descriptor covered")
	}
}
