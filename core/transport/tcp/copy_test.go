package tcp

import (
	"context"
	"crypto/rand"
	"os/exec"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/mcguard/mcguard/core/desc"
	"github.com/mcguard/mcguard/core/internal/testmem"
	"github.com/mcguard/mcguard/core/memory"
	"github.com/mcguard/mcguard/core/transport/samehost"
)

// A copy into a receiver's mapped allocation, or out of it, counts only
// where the receiving process was still there when it ended: its pages
// outlive it in the sender's mapping.
func TestMappedCopiesFailOnceTheReceiverIsGone(t *testing.T) {
	l, p, err := samehost.NewLeasePairForTest(time.Second)
	require.NoError(t, err)
	defer l.Close()
	defer p.Close()
	f, err := samehost.AllocShared(4096, "receiver")
	require.NoError(t, err)
	defer f.Free()
	l.Add(f.Addr, f.Len, *f)
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
	done, err = c.pullRanges([]desc.Range{{Addr: f.Addr, Len: 4096}}, out)
	require.NoError(t, err)
	require.True(t, done)
	require.Equal(t, src, out)

	// The receiver's pidfd now names a process that has exited.
	child := exec.Command("true")
	require.NoError(t, child.Start())
	gone, err := unix.PidfdOpen(child.Process.Pid, 0)
	require.NoError(t, err)
	require.NoError(t, child.Wait())
	p.WatchTargetForTest(gone)
	_, err = c.push(context.Background(), descs)
	require.ErrorContains(t, err, "has exited")
	_, err = c.pullRanges([]desc.Range{{Addr: f.Addr, Len: 4096}}, out)
	require.ErrorContains(t, err, "has exited")
}
