package samehost

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/core/cuda"
)

// fakeOpener stands for the driver: each open maps a new address.
type fakeOpener struct {
	open   map[uint64]bool
	next   uint64
	closed int
	fail   bool
}

func (f *fakeOpener) OpenIPC([cuda.IPCHandleSize]byte, int) (uint64, uint64, error) {
	if f.fail {
		return 0, 0, errors.New("refused")
	}
	f.next += 1 << 20
	f.open[f.next] = true
	return f.next, 1 << 20, nil
}

func (f *fakeOpener) CloseIPC(ptr uint64, _ int) error {
	if !f.open[ptr] {
		return errors.New("not open")
	}
	delete(f.open, ptr)
	f.closed++
	return nil
}

func key(i int) IPCKey {
	var k IPCKey
	k.Handle[0], k.Handle[1] = byte(i), byte(i>>8)
	return k
}

func TestIPCMapsAreSharedBoundedPerSenderAndDropped(t *testing.T) {
	f := &fakeOpener{open: map[uint64]bool{}}
	var s IPCMaps
	a, err := s.Acquire(f, 100, key(1))
	require.NoError(t, err)
	b, err := s.Acquire(f, 100, key(1))
	require.NoError(t, err)
	require.Same(t, a, b, "a handle is opened once and shared")
	_, err = s.Acquire(f, 200, key(1))
	require.Error(t, err, "another process cannot name a handle open for this one")
	s.Release(a)
	s.Release(b)

	// One sender fills its share: its least recently used idle mapping goes.
	for i := 2; i <= maxIPCMapsPerSender+10; i++ {
		m, err := s.Acquire(f, 100, key(i))
		require.NoError(t, err)
		s.Release(m)
	}
	require.Equal(t, maxIPCMapsPerSender, s.Count())
	require.Len(t, f.open, maxIPCMapsPerSender, "evicted mappings are closed")

	// Mappings in use are never closed; when all are, a new one is refused.
	var held []*IPCMap
	for i := 1000; i < 1000+maxIPCMapsPerSender; i++ {
		m, err := s.Acquire(f, 300, key(i))
		require.NoError(t, err)
		held = append(held, m)
	}
	_, err = s.Acquire(f, 300, key(5000))
	require.ErrorContains(t, err, "in use")
	for _, m := range held {
		s.Release(m)
	}

	// A sender gone: its idle mappings are closed, the others' kept.
	s.Drop(f, 300)
	require.Equal(t, maxIPCMapsPerSender, s.Count())
	s.Drop(f, 0)
	require.Zero(t, s.Count())
	require.Empty(t, f.open)

	f.fail = true
	_, err = s.Acquire(f, 100, key(1))
	require.ErrorContains(t, err, "refused")
	require.Zero(t, s.Count())
}
