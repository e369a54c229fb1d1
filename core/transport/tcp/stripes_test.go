package tcp

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/core/desc"
	"github.com/mcguard/mcguard/core/transport"
)

// shares cuts descs as a session with four open parts would, returning
// each part's run as batch byte offsets [lo, hi) and its base index.
func shares(t *testing.T, descs []desc.Desc, whole bool) (runs [][3]uint64) {
	t.Helper()
	s := newStriped(&conn{}, 4, nil)
	s.parts = append(s.parts, &conn{}, &conn{}, &conn{})
	n := s.share(context.Background(), descs, 10, whole)
	// the batch offset of each source address (Src is the offset here)
	for p := range n {
		r := s.runs[p]
		if len(r.descs) == 0 {
			runs = append(runs, [3]uint64{0, 0, 0})
			continue
		}
		last := r.descs[len(r.descs)-1]
		runs = append(runs, [3]uint64{r.descs[0].Src, last.Src + last.Len, uint64(r.base)})
		for i, d := range r.descs {
			orig := descs[r.base-10+i]
			require.True(t, d.Src >= orig.Src && d.Src+d.Len <= orig.Src+orig.Len, "part %d descriptor %d inside its original", p, i)
			require.Equal(t, d.Src-orig.Src, d.Dst-orig.Dst, "source and destination move together")
			// A piece starts and ends on its descriptor's MaxSlice grid (or
			// at its ends): the frames are those of one connection.
			require.Zero(t, (d.Src-orig.Src)%transport.MaxSlice, "part %d descriptor %d starts on the grid", p, i)
			if end := d.Src + d.Len - orig.Src; end != orig.Len {
				require.Zero(t, end%transport.MaxSlice, "part %d descriptor %d ends on the grid", p, i)
			}
		}
	}
	return runs
}

// batch is descriptors of the given lengths, laid end to end from 0
// (Src is the batch offset; Dst another space).
func batch(lens ...uint64) []desc.Desc {
	var out []desc.Desc
	var at uint64
	for _, n := range lens {
		out = append(out, desc.Desc{Src: at, Dst: 1<<40 + at, Len: n})
		at += n
	}
	return out
}

func TestStripeShares(t *testing.T) {
	const q = 256 << 10
	even := make([]uint64, 64)
	for i := range even {
		even[i] = q
	}
	for _, whole := range []bool{true, false} {
		require.Equal(t, [][3]uint64{{0, 16 * q, 10}, {16 * q, 32 * q, 26}, {32 * q, 48 * q, 42}, {48 * q, 64 * q, 58}}, shares(t, batch(even...), whole), "equal shares")
		require.Equal(t, [][3]uint64{{0, 2 * q, 10}, {2 * q, 4 * q, 12}, {4 * q, 6 * q, 14}, {6 * q, 8 * q, 16}}, shares(t, batch(even[:8]...), whole), "2 MiB is striped too")
		require.Equal(t, [][3]uint64{{0, 8192, 10}}, shares(t, batch(4096, 4096), whole), "a small batch stays on the first")
	}
	require.Equal(t, [][3]uint64{{0, 64 << 20, 10}}, shares(t, batch(64<<20), true), "marked writes: a descriptor is not cut")
	require.Equal(t, [][3]uint64{{0, 16 << 20, 10}, {16 << 20, 32 << 20, 10}, {32 << 20, 48 << 20, 10}, {48 << 20, 64 << 20, 10}},
		shares(t, batch(64<<20), false), "one descriptor over every part")

	// shares of 6 MiB + 1 KiB: cuts at 6, 12 and 18 MiB (and a little) move to 8, 12 and 20
	require.Equal(t, [][3]uint64{{0, 8 << 20, 10}, {8 << 20, 12 << 20, 10}, {12 << 20, 20 << 20, 10}, {20 << 20, 24<<20 + 4096, 10}},
		shares(t, batch(24<<20+4096), false), "cuts move to the nearest 4 MiB of the descriptor")
	require.Equal(t, [][3]uint64{{0, 8 << 20, 10}, {8 << 20, 12 << 20, 10}, {12 << 20, 20 << 20, 11}, {20 << 20, 24 << 20, 11}},
		shares(t, batch(12<<20, 12<<20), false), "across descriptors: each cut on its own descriptor's grid")

	uneven := batch(5<<20, 1<<20, 4096, 2<<20, 123, 1<<20+77)
	var total uint64
	for _, d := range uneven {
		total += d.Len
	}
	for _, whole := range []bool{true, false} {
		runs := shares(t, uneven, whole)
		var covered uint64
		for _, r := range runs {
			if r[1] > r[0] {
				require.Equal(t, covered, r[0], "contiguous, in order")
				covered = r[1]
			}
		}
		require.Equal(t, total, covered, "whole %v", whole)

	}
}
