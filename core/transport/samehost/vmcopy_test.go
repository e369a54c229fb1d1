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

// ReadSpans fills several pieces from one span, past IOV_MAX iovecs on
// either side in several calls; pieces that do not fill their spans, or
// a span of unmapped memory, fail it.
func TestReadSpansFillsPiecesFromSpans(t *testing.T) {
	const spans, perSpan, piece = 700, 3, 16 // 2100 pieces: three calls' worth
	src := make([]byte, spans*perSpan*piece)
	for i := range src {
		src[i] = byte(i*13 + 5)
	}
	out := make([]byte, len(src))
	var local []unix.Iovec
	var remote []unix.RemoteIovec
	for s := 0; s < spans; s++ {
		at := (spans - 1 - s) * perSpan * piece // the spans in reverse order
		remote = append(remote, unix.RemoteIovec{Base: uintptr(unsafe.Pointer(&src[at])), Len: perSpan * piece})
		for k := 0; k < perSpan; k++ {
			lv := unix.Iovec{Base: &out[(s*perSpan+k)*piece]}
			lv.SetLen(piece)
			local = append(local, lv)
		}
	}
	require.NoError(t, ReadSpans(os.Getpid(), local, remote))
	for s := 0; s < spans; s++ {
		at := (spans - 1 - s) * perSpan * piece
		require.Equal(t, src[at:at+perSpan*piece], out[s*perSpan*piece:(s+1)*perSpan*piece])
	}

	short := []unix.RemoteIovec{{Base: uintptr(unsafe.Pointer(&src[0])), Len: 2 * piece}}
	require.ErrorContains(t, ReadSpans(os.Getpid(), local[:1], short), "do not fill")
	hole, err := unix.Mmap(-1, 0, 4096, unix.PROT_NONE, unix.MAP_PRIVATE|unix.MAP_ANON)
	require.NoError(t, err)
	defer unix.Munmap(hole)
	bad := []unix.RemoteIovec{{Base: uintptr(unsafe.Pointer(&hole[0])), Len: piece}}
	require.Error(t, ReadSpans(os.Getpid(), local[:1], bad), "unreadable memory")
}
