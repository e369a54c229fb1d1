package samehost

import (
	"bytes"
	"os"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// Copy goes past IOV_MAX pairs in several calls, into this process.
func TestVMCopyManyPairs(t *testing.T) {
	const pairs, size = 1500, 24
	src := make([]byte, pairs*size)
	dst := make([]byte, pairs*size)
	for i := range src {
		src[i] = byte(i * 7)
	}
	local := make([]unix.Iovec, pairs)
	remote := make([]unix.RemoteIovec, pairs)
	for i := range local {
		local[i] = unix.Iovec{Base: &src[i*size]}
		local[i].SetLen(size)
		remote[i] = unix.RemoteIovec{Base: uintptr(unsafe.Pointer(&dst[(pairs-1-i)*size])), Len: size}
	}
	require.NoError(t, Copy(os.Getpid(), local, remote, true))
	for i := 0; i < pairs; i++ {
		require.Equal(t, src[i*size:(i+1)*size], dst[(pairs-1-i)*size:(pairs-i)*size])
	}
}

// CopyParallel cuts a large batch over several threads, cutting pairs
// where a run ends: one big pair, and uneven ones, land whole.
func TestVMCopyParallelCutsPairs(t *testing.T) {
	for _, sizes := range [][]int{{9<<20 + 13}, {3 << 20, 1, 5<<20 + 7, 4096, 2 << 20}} {
		var total int
		for _, n := range sizes {
			total += n
		}
		src, dst := make([]byte, total), make([]byte, total)
		for i := range src {
			src[i] = byte(i*131 + i>>11)
		}
		var local []unix.Iovec
		var remote []unix.RemoteIovec
		off := 0
		for _, n := range sizes {
			lv := unix.Iovec{Base: &src[off]}
			lv.SetLen(n)
			local = append(local, lv)
			remote = append(remote, unix.RemoteIovec{Base: uintptr(unsafe.Pointer(&dst[off])), Len: n})
			off += n
		}
		require.NoError(t, CopyParallel(os.Getpid(), local, remote, uint64(total)))
		require.True(t, bytes.Equal(src, dst), "%v", sizes)
	}
}
