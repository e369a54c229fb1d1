package tcp

import (
	"context"
	"crypto/rand"
	"runtime"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/core/desc"
	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/core/internal/testmem"
	"github.com/mcguard/mcguard/core/memory"
	"github.com/mcguard/mcguard/core/transport"
	"github.com/mcguard/mcguard/core/wire"
)

// A read-back with the next chunk's writes posted behind it answers with
// this chunk's bytes even where the next chunk writes the same place: the
// target applies in order. The answers here are 8 MiB, more than the
// socket buffers hold while the next chunk's 8 MiB go out, so the test
// also shows that the two directions do not wait on each other.
func TestReadPostingAnswersThisChunkOnly(t *testing.T) {
	const half = 8 << 20
	src, dst := testmem.Pages(t, 2*half/4096), testmem.Pages(t, half/4096)
	c := joinPair(t, src, dst, nil, nil, nil)
	ctx := context.Background()
	whole := []desc.Range{{Addr: memory.AddrOf(dst), Len: half}}
	out := make([]byte, half)
	for round := range 3 {
		rand.Read(src)
		chunk := []desc.Desc{{Src: memory.AddrOf(src), Dst: memory.AddrOf(dst), Len: half}}
		next := []desc.Desc{{Src: memory.AddrOf(src[half:]), Dst: memory.AddrOf(dst), Len: half}}
		require.NoError(t, c.Post(ctx, chunk, 0))
		var arrived uint64
		posted, err := c.ReadPosting(ctx, whole, out, func(n uint64) { arrived = n }, next, 1)
		require.NoError(t, err)
		require.True(t, posted, "round %d", round)
		require.Equal(t, uint64(half), arrived)
		require.Equal(t, src[:half], out, "the answer is the chunk's, not the next chunk's written after it")
		require.True(t, c.unfenced, "the next chunk's writes are not fenced yet")

		require.NoError(t, c.ReadArriving(ctx, whole, out, true, nil))
		require.Equal(t, src[half:], out)
		require.Equal(t, src[half:], dst)
		require.Empty(t, c.owed)
	}
}

// Where the next chunk would take more frames than may be left owed, or
// the connection writes on the same host, ReadPosting posts nothing and
// reads as ReadArriving does: the caller writes the next chunk itself.
func TestReadPostingDeclines(t *testing.T) {
	src, dst := testmem.Pages(t, 2*maxOwed), testmem.Pages(t, 2*maxOwed)
	rand.Read(src)
	c := joinPair(t, src, dst, nil, nil, nil)
	ctx := context.Background()
	chunk := []desc.Desc{{Src: memory.AddrOf(src), Dst: memory.AddrOf(dst), Len: 4096}}
	next := make([]desc.Desc, maxOwed) // backwards: none joins
	for i := range next {
		next[i] = desc.Desc{Src: memory.AddrOf(src[(i+1)*4096:]), Dst: memory.AddrOf(dst[(2*maxOwed-1-i)*4096:]), Len: 4096}
	}
	out := make([]byte, 64)
	ranges := []desc.Range{{Addr: memory.AddrOf(dst[4032:]), Len: 64}}
	require.NoError(t, c.Post(ctx, chunk, 0))
	posted, err := c.ReadPosting(ctx, ranges, out, nil, next, 1)
	require.NoError(t, err)
	require.False(t, posted)
	require.Equal(t, src[4032:4096], out)
	require.Nil(t, c.poster, "no poster goroutine started")

	c.pull = true // as if on the same host (nothing is written this time)
	posted, err = c.ReadPosting(ctx, ranges, out, nil, next[:1], 1)
	require.NoError(t, err)
	require.False(t, posted, "on the same host the writes are not the socket's")
}

// A next chunk the target refuses fails at its own fence, naming its
// descriptor; the chunk checked before it is unaffected.
func TestReadPostingRefusedNextFailsAtItsFence(t *testing.T) {
	src, dst := testmem.Pages(t, 2), testmem.Pages(t, 1)
	rand.Read(src)
	c := joinPair(t, src, dst, nil, nil, nil)
	ctx := context.Background()
	chunk := []desc.Desc{{Src: memory.AddrOf(src), Dst: memory.AddrOf(dst), Len: 4096}}
	next := []desc.Desc{{Src: memory.AddrOf(src[4096:]), Dst: memory.AddrOf(dst) + 1<<30, Len: 4096}}
	out := make([]byte, 64)
	require.NoError(t, c.Post(ctx, chunk, 0))
	posted, err := c.ReadPosting(ctx, []desc.Range{{Addr: memory.AddrOf(dst[4032:]), Len: 64}}, out, nil, next, 7)
	require.NoError(t, err)
	require.True(t, posted)
	require.Equal(t, src[4032:4096], out)
	err = c.Fence(ctx)
	require.ErrorIs(t, err, errs.NotRegistered)
	require.Contains(t, err.Error(), "descriptor 7")
}

// The poster goroutine lives as long as its connection: closing
// connections that posted ahead leaves no goroutine behind.
func TestPosterEndsWithItsConnection(t *testing.T) {
	src, dst := testmem.Pages(t, 2), testmem.Pages(t, 2)
	ctx := context.Background()
	c := joinPair(t, src, dst, nil, nil, nil) // its target stays up
	chunk := []desc.Desc{{Src: memory.AddrOf(src), Dst: memory.AddrOf(dst), Len: 4096}}
	next := []desc.Desc{{Src: memory.AddrOf(src[4096:]), Dst: memory.AddrOf(dst[4096:]), Len: 4096}}
	ranges := []desc.Range{{Addr: memory.AddrOf(dst[4032:]), Len: 64}}
	out := make([]byte, 64)
	post := func(c *conn) {
		require.NoError(t, c.Post(ctx, chunk, 0))
		posted, err := c.ReadPosting(ctx, ranges, out, nil, next, 1)
		require.NoError(t, err)
		require.True(t, posted)
		require.NoError(t, c.Fence(ctx))
	}
	post(c)
	before := runtime.NumGoroutine()
	for range 20 {
		// The same sender again: the target replaces its older connection.
		peer := transport.Peer{Token: make([]byte, wire.TokenSize), Key: []byte("key")}
		d, err := dial(ctx, c.c.RemoteAddr().String(), peer, c.peer, 0, &Config{Timeout: 5 * time.Second, Regions: c.local}, 0)
		require.NoError(t, err)
		d.hostOnly = true
		post(d)
		d.Close()
	}
	require.Eventually(t, func() bool { return runtime.NumGoroutine() <= before+2 }, 5*time.Second, 10*time.Millisecond,
		"goroutines: %d before, %d after 20 connections closed", before, runtime.NumGoroutine())
}

// Where the target's answers to writes are final, a fence is those
// answers: Fence and a fenced read-back send no fence frame, and the
// bytes are in place all the same. Elsewhere each sends one.
func TestFenceIsTheWritesAnswersWhereFinal(t *testing.T) {
	for _, final := range []bool{true, false} {
		src, dst := testmem.Pages(t, 2), testmem.Pages(t, 2)
		c := joinPair(t, src, dst, nil, nil, nil)
		c.acksFinal = final
		ctx := context.Background()
		chunk := []desc.Desc{{Src: memory.AddrOf(src), Dst: memory.AddrOf(dst), Len: 8192}}
		frames := func(do func() error) uint64 {
			rand.Read(src)
			require.NoError(t, c.Post(ctx, chunk, 0))
			before := c.nextID
			require.NoError(t, do())
			require.Empty(t, c.owed)
			require.False(t, c.unfenced)
			return c.nextID - before
		}
		fences := map[bool]uint64{true: 0, false: 1}[final]
		require.Equal(t, fences, frames(func() error { return c.Fence(ctx) }), "final %v", final)
		require.Equal(t, src, dst)
		out := make([]byte, 8192)
		whole := []desc.Range{{Addr: memory.AddrOf(dst), Len: 8192}}
		require.Equal(t, fences+1, frames(func() error { return c.ReadArriving(ctx, whole, out, true, nil) }), "final %v", final)
		require.Equal(t, src, out)
	}
}
