package samehost

import (
	"bytes"
	"crypto/rand"
	"runtime"
	"testing"

	"github.com/stretchr/testify/require"
)

// A large batch is cut into runs over several goroutines, pairs split
// where a run ends: every byte lands where it belongs, nothing else moves.
func TestCopyPairsCutsPairsExactly(t *testing.T) {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(4))
	sizes := []int{3 << 20, 1, 4096, 5<<20 + 7, 0, 777, 2 << 20}
	var pairs []CopyPair
	var total uint64
	var srcs, dsts [][]byte
	for _, n := range sizes {
		src, dst := make([]byte, n), make([]byte, n+2) // a guard byte each side
		rand.Read(src)
		dst[0], dst[n+1] = 0xAA, 0xBB
		pairs = append(pairs, CopyPair{Dst: dst[1 : n+1], Src: src})
		srcs, dsts = append(srcs, src), append(dsts, dst)
		total += uint64(n)
	}
	require.GreaterOrEqual(t, total, uint64(ParallelMin))
	CopyPairs(pairs, total)
	for i := range sizes {
		require.True(t, bytes.Equal(srcs[i], dsts[i][1:len(dsts[i])-1]), "pair %d", i)
		require.Equal(t, []byte{0xAA, 0xBB}, []byte{dsts[i][0], dsts[i][len(dsts[i])-1]}, "pair %d: nothing past its ends", i)
	}
}
