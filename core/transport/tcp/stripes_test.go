package tcp

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/verify"
)

func TestStripeRuns(t *testing.T) {
	s := &striped{parts: make([]*conn, 4)}
	descs := make([]verify.Desc, 64)
	for i := range descs {
		descs[i].Len = 256 << 10
	}
	require.Equal(t, [][2]int{{0, 16}, {16, 32}, {32, 48}, {48, 64}}, s.runs(descs), "equal shares")
	require.Equal(t, [][2]int{{0, 2}, {2, 4}, {4, 6}, {6, 8}}, s.runs(descs[:8]), "2 MiB is striped too")
	small := []verify.Desc{{Len: 4096}, {Len: 4096}}
	require.Equal(t, [][2]int{{0, 2}, {0, 0}, {0, 0}, {0, 0}}, s.runs(small), "a small batch stays on the first")
	one := []verify.Desc{{Len: 64 << 20}}
	require.Equal(t, [][2]int{{0, 1}, {0, 0}, {0, 0}, {0, 0}}, s.runs(one), "a descriptor is never split")
	uneven := []verify.Desc{{Len: 5 << 20}, {Len: 1 << 20}, {Len: 1 << 20}, {Len: 1 << 20}, {Len: 1 << 20}}
	runs := s.runs(uneven)
	require.Equal(t, [2]int{0, 1}, runs[0], "the big one alone")
	covered := 0
	for _, r := range runs {
		if r[1] > r[0] {
			require.Equal(t, covered, r[0], "contiguous, in order")
			covered = r[1]
		}
	}
	require.Equal(t, len(uneven), covered)
}
