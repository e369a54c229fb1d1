package tcp

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/core/desc"
)

// land runs one whole descriptor through a connection's landing.
func land(x *landedIndex, l *landing, addr uint64, b []byte) *landed {
	e := l.before(x, addr, uint64(len(b)), true)
	x.wrote(addr, uint64(len(b)), e)
	l.digest(e, addr, b)
	l.finish(x, e)
	return e
}

func TestLandedIndex(t *testing.T) {
	var x landedIndex
	var l landing
	b := make([]byte, 3<<20) // spans buckets
	b[5] = 7
	e := land(&x, &l, 1<<20+100, b)
	d, ok := x.digestOf(e)
	require.True(t, ok)
	require.Equal(t, desc.DigestOf(b), d)

	x.wrote(1<<30, 4096, nil)
	_, ok = x.digestOf(e)
	require.True(t, ok, "a write elsewhere leaves it")
	x.wrote(1<<20+100+3<<20-1, 1, nil)
	_, ok = x.digestOf(e)
	require.False(t, ok, "a write over its last byte invalidates it")
	require.Empty(t, x.buckets, "and it left the index")

	// Slices out of order, or of another descriptor, abandon it.
	e = l.before(&x, 0, 8192, true)
	l.digest(e, 4096, b[:4096])
	l.finish(&x, e)
	_, ok = x.digestOf(e)
	require.False(t, ok)
	require.Nil(t, l.before(&x, 8192, 8192, false), "a continuation with nothing landing is not marked")

	// The index is bounded, in all and per bucket: the oldest entries go first.
	first := land(&x, &l, 0, b[:16])
	for i := 1; i <= maxPerBucket; i++ {
		land(&x, &l, uint64(i)*64, b[:16])
	}
	_, ok = x.digestOf(first)
	require.False(t, ok, "crowded out of its bucket")
	require.Len(t, x.buckets[0], maxPerBucket)
	first = land(&x, &l, 1<<40, b[:16])
	for i := 1; i <= maxLanded; i++ {
		land(&x, &l, 1<<40+uint64(i)<<20, b[:16])
	}
	_, ok = x.digestOf(first)
	require.False(t, ok, "crowded out of the index")
	require.LessOrEqual(t, len(x.fifo)-x.head, maxLanded)

	x.forgetAll()
	require.Empty(t, x.buckets)
	require.Zero(t, x.slots)

	// Long descriptors take a slot per bucket; the slots are bounded too.
	for i := 0; i < 2*maxSlots/1024; i++ {
		x.begin(uint64(i)<<40, 1024<<bucketShift-1)
	}
	require.LessOrEqual(t, x.slots, maxSlots)

	// Marks round-trip; too long a descriptor is not marked.
	n, f := unmark(mark(12345, true))
	require.EqualValues(t, 12345, n)
	require.True(t, f)
	require.Zero(t, mark(1<<30, false))
}
