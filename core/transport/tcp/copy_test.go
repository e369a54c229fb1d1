package tcp

import (
	"bytes"
	"context"
	"crypto/rand"
	"github.com/mcguard/mcguard/core/desc"
	"os/exec"
	"runtime"
	"testing"
	"time"
	"unsafe"

	"github.com/mcguard/mcguard/core/internal/testmem"

	"github.com/mcguard/mcguard/core/memory"
	"github.com/mcguard/mcguard/core/sharedmem"
	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/core/transport/samehost"
	"golang.org/x/sys/unix"
)

// A large batch is cut into runs over several goroutines, pairs split
// where a run ends: every byte lands where it belongs, nothing else moves.
func TestCopyParallelCutsPairsExactly(t *testing.T) {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(4))
	sizes := []int{3 << 20, 1, 4096, 5<<20 + 7, 0, 777, 2 << 20}
	var pairs []copyPair
	var total uint64
	var srcs, dsts [][]byte
	for _, n := range sizes {
		src, dst := make([]byte, n), make([]byte, n+2) // a guard byte each side
		rand.Read(src)
		dst[0], dst[n+1] = 0xAA, 0xBB
		pairs = append(pairs, copyPair{dst[1 : n+1], src})
		srcs, dsts = append(srcs, src), append(dsts, dst)
		total += uint64(n)
	}
	require.GreaterOrEqual(t, total, uint64(samehost.ParallelMin))
	copyParallel(pairs, total)
	for i := range sizes {
		require.True(t, bytes.Equal(srcs[i], dsts[i][1:len(dsts[i])-1]), "pair %d", i)
		require.Equal(t, []byte{0xAA, 0xBB}, []byte{dsts[i][0], dsts[i][len(dsts[i])-1]}, "pair %d: nothing past its ends", i)
	}
}

// A copy into a receiver's mapped allocation, or out of it, counts only
// where the receiving process was still there when it ended: its pages
// outlive it in the sender's mapping.
func TestMappedCopiesFailOnceTheReceiverIsGone(t *testing.T) {
	l, p := newLeasePair(t, time.Second)
	f, err := sharedmem.Alloc(4096, "receiver")
	require.NoError(t, err)
	defer f.Free()
	l.add(f.Addr, f.Len, *f)
	src := testmem.Map(t, 4096) // as the library's callers' memory: not Go's heap
	rand.Read(src)
	local := memory.New(nil)
	require.NoError(t, local.Add(uint64(uintptr(unsafe.Pointer(&src[0]))), 4096))
	c := &conn{local: local, lease: p}
	descs := []desc.Desc{{Src: uint64(uintptr(unsafe.Pointer(&src[0]))), Dst: f.Addr, Len: 4096}}
	done, err := c.push(context.Background(), descs)
	require.NoError(t, err)
	require.True(t, done)
	require.Equal(t, src, memory.BytesAt(f.Addr, 4096), "by memcpy into the mapping")
	out := make([]byte, 4096)
	done, err = c.pullRanges(rng(f.Addr, 4096), out)
	require.NoError(t, err)
	require.True(t, done)
	require.Equal(t, src, out)

	// The receiver's pidfd now names a process that has exited.
	child := exec.Command("true")
	require.NoError(t, child.Start())
	gone, err := unix.PidfdOpen(child.Process.Pid, 0)
	require.NoError(t, err)
	require.NoError(t, child.Wait())
	unix.Close(p.pidfd)
	p.pidfd = gone
	_, err = c.push(context.Background(), descs)
	require.ErrorContains(t, err, "has exited")
	_, err = c.pullRanges(rng(f.Addr, 4096), out)
	require.ErrorContains(t, err, "has exited")
}
