package samehost

import (
	"os"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

func TestAllocIsSealedZeroedAndFound(t *testing.T) {
	f, err := AllocShared(5000, "a")
	require.NoError(t, err)
	require.EqualValues(t, 8192, f.Len, "whole pages")
	require.Equal(t, make([]byte, f.Len), f.mem)
	sharedSeals, err := unix.FcntlInt(uintptr(f.FD), unix.F_GET_SEALS, 0)
	require.NoError(t, err)
	require.Equal(t, sharedSeals&(unix.F_SEAL_SHRINK|unix.F_SEAL_GROW), unix.F_SEAL_SHRINK|unix.F_SEAL_GROW)
	require.Error(t, unix.Ftruncate(f.FD, 4096), "it cannot shrink under a peer's mapping")
	got, ok := LookupShared(f.Addr+100, 200, "a")
	require.True(t, ok)
	require.Equal(t, f.FD, got.FD)
	_, ok = LookupShared(f.Addr+100, 200, "b")
	require.False(t, ok, "another owner's")
	_, ok = LookupShared(f.Addr+8000, 200, "a")
	require.False(t, ok, "past its end")
	require.NoError(t, f.Free())
	require.Error(t, f.Free(), "freed twice")
	_, ok = LookupShared(f.Addr, 1, "a")
	require.False(t, ok)
	_, err = AllocShared(0, "a")
	require.Error(t, err)
}

// A peer's mapping shows the owner's bytes both ways, is shared between
// holders, and outlives the owner's Free until the last holder lets go.
func TestAttachSharesOneMapping(t *testing.T) {
	f, err := AllocShared(4096, "a")
	require.NoError(t, err)
	pid := os.Getpid()
	a, err := AttachShared(pid, f.FD, f.Ino, f.Len)
	require.NoError(t, err)
	b, err := AttachShared(pid, f.FD, f.Ino, f.Len)
	require.NoError(t, err)
	require.Same(t, a, b)
	_, err = AttachShared(pid, f.FD, f.Ino, 2*f.Len)
	require.ErrorContains(t, err, "not the shared buffer", "a size its sealed file cannot have")
	require.Equal(t, 1, SharedMapped())
	a.Mem[7] = 42
	require.EqualValues(t, 42, f.mem[7], "the very pages")
	require.NoError(t, f.Free())
	a.Release()
	b.Mem[8] = 1 // still mapped for its other holder
	b.Release()
	require.Equal(t, 0, SharedMapped())
}

func TestAttachRefusesAFileItWasNotTold(t *testing.T) {
	f, err := AllocShared(4096, "a")
	require.NoError(t, err)
	defer f.Free()
	pid := os.Getpid()
	_, err = AttachShared(pid, f.FD, f.Ino+1, f.Len)
	require.ErrorContains(t, err, "not the shared buffer")
	_, err = AttachShared(pid, f.FD, f.Ino, 2*f.Len)
	require.ErrorContains(t, err, "not the shared buffer")

	fd, err := unix.MemfdCreate("unsealed", unix.MFD_CLOEXEC)
	require.NoError(t, err)
	defer unix.Close(fd)
	require.NoError(t, unix.Ftruncate(fd, 4096))
	var st unix.Stat_t
	require.NoError(t, unix.Fstat(fd, &st))
	_, err = AttachShared(pid, fd, st.Ino, 4096)
	require.ErrorContains(t, err, "not sealed", "a file that could shrink under the mapping (SIGBUS)")
	_, err = AttachShared(pid, 9999, 1, 4096)
	require.ErrorContains(t, err, "pidfd_getfd")
	require.Equal(t, 0, SharedMapped())
}
