package transport

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/verify"
)

// walk returns every slice a cursor over descs yields, and how often it
// asked reach.
func walk(descs []verify.Desc, reach func(src, dst uint64) uint64) (out []Slice, asked int) {
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
func blocks(n int, size uint64) []verify.Desc {
	d := make([]verify.Desc, n)
	for i := range d {
		d[i] = verify.Desc{Src: 1 << 40, Dst: 1 << 41, Len: size}
		d[i].Src += uint64(i) * size
		d[i].Dst += uint64(i) * size
	}
	return d
}

func far(uint64, uint64) uint64 { return 1 << 50 }

func TestCursorWithoutReachCutsOnly(t *testing.T) {
	descs := append(blocks(3, 4096), verify.Desc{Src: 1 << 42, Dst: 1 << 43, Len: MaxSlice + 10})
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
	mixed = append(mixed, verify.Desc{Src: mixed[1].Src + 4096, Dst: mixed[1].Dst + 4096, Len: MaxSlice + 1})
	got, _ = walk(mixed, far)
	require.Equal(t, []Slice{
		{Desc: 0, Joined: 1, Src: mixed[0].Src, Dst: mixed[0].Dst, Len: 8192},
		{Desc: 2, Src: mixed[2].Src, Dst: mixed[2].Dst, Len: MaxSlice},
		{Desc: 2, Src: mixed[2].Src + MaxSlice, Dst: mixed[2].Dst + MaxSlice, Len: 1},
	}, got, "a large descriptor is cut as always, never joined")
}
