package tcp

import (
	"bytes"
	"context"
	"crypto/rand"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/core/desc"
	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/core/fault"
	"github.com/mcguard/mcguard/core/internal/testmem"
	"github.com/mcguard/mcguard/core/memory"
	"github.com/mcguard/mcguard/core/transport"
	"github.com/mcguard/mcguard/core/wire"
)

// joinPair is a target with dst registered as the regions dstAt cuts it
// into, and a sender's connection to it with src registered as srcAt cuts
// it, that believes the target's table is table (its handshake's).
func joinPair(t *testing.T, src, dst []byte, srcAt, dstAt []int, table []memory.Region) *conn {
	cut := func(b []byte, at []int) *memory.Regions {
		r, from := memory.New(nil), 0
		for _, to := range append(at, len(b)) {
			require.NoError(t, r.Add(memory.AddrOf(b[from:]), uint64(to-from)))
			from = to
		}
		return r
	}
	targetRegions := cut(dst, dstAt)
	if table == nil {
		table = targetRegions.Snapshot()
	}
	token, key := make([]byte, wire.TokenSize), []byte("key")
	tg := serveOn(mustListen(t), Config{Timeout: 5 * time.Second, Regions: targetRegions, Faults: fault.Config{Mode: fault.None},
		Tokens: func(tok []byte) (string, []byte, bool) { return "sender", key, bytes.Equal(tok, token) }})
	t.Cleanup(tg.close)
	c, err := dial(context.Background(), tg.addr(), transport.Peer{Token: token, Key: key}, newPeerTable(table), 0,
		&Config{Timeout: 5 * time.Second, Regions: cut(src, srcAt)}, 0)
	require.NoError(t, err)
	t.Cleanup(c.Close)
	c.hostOnly = true // the target has no CUDA driver (its answer says so)
	return c
}

// post writes descs and returns how many write frames carried them.
func post(t *testing.T, c *conn, descs []desc.Desc) (frames int, err error) {
	if err = c.Post(context.Background(), descs, 0); err != nil {
		return 0, err
	}
	frames = len(c.owed)
	return frames, c.readOwed(context.Background())
}

// Consecutive blocks go as one write per run, and a run ends where a
// region ends, at either side: the target, which checks each write
// against one region, takes every write, and every byte lands.
func TestJoinedWritesStayInsideRegions(t *testing.T) {
	const size = 2048
	src, dst := testmem.Pages(t, 4), testmem.Pages(t, 4)
	rand.Read(src)
	c := joinPair(t, src, dst, []int{4096}, []int{8192}, nil)
	descs := make([]desc.Desc, 8)
	for i := range descs {
		descs[i] = desc.Desc{Src: memory.AddrOf(src[i*size:]), Dst: memory.AddrOf(dst[i*size:]), Len: size}
	}
	frames, err := post(t, c, descs)
	require.NoError(t, err)
	require.Equal(t, 3, frames, "runs end at the sender's region end (4 KiB) and the target's (8 KiB)")
	require.Equal(t, src, dst)

	// A target with a CUDA driver may hold device regions that span
	// allocations: nothing is joined for it.
	c.hostOnly = false
	rand.Read(src)
	frames, err = post(t, c, descs)
	require.NoError(t, err)
	require.Equal(t, 8, frames)
	require.Equal(t, src, dst)
	c.hostOnly = true

	// Backwards at the destination: nothing continues, one write each.
	rand.Read(src)
	for i := range descs {
		descs[i].Dst = memory.AddrOf(dst[(7-i)*size:])
	}
	frames, err = post(t, c, descs)
	require.NoError(t, err)
	require.Equal(t, 8, frames)
	for i := range descs {
		require.Equal(t, src[i*size:(i+1)*size], dst[(7-i)*size:(8-i)*size])
	}
}

// A sender whose table is older than the target's registrations (one
// region since cut in two) sends a write that crosses the new boundary:
// the target refuses it, and the error names every descriptor it carried.
func TestJoinedWriteRefusedNamesItsDescriptors(t *testing.T) {
	src, dst := testmem.Pages(t, 2), testmem.Pages(t, 2)
	stale := []memory.Region{{Addr: memory.AddrOf(dst), Len: uint64(len(dst))}}
	c := joinPair(t, src, dst, nil, []int{4096}, stale)
	descs := []desc.Desc{
		{Src: memory.AddrOf(src), Dst: memory.AddrOf(dst), Len: 4096},
		{Src: memory.AddrOf(src[4096:]), Dst: memory.AddrOf(dst[4096:]), Len: 4096},
	}
	frames, err := post(t, c, descs)
	require.ErrorIs(t, err, errs.NotRegistered)
	require.ErrorIs(t, err, transport.ErrJoinRefused, "the caller may learn the new table and write again")
	require.Contains(t, err.Error(), "descriptors 0 to 1 (written as one)")
	require.Equal(t, 1, frames)

	// With the table refreshed, the same batch goes as two writes.
	require.NoError(t, c.Refresh(nil, []memory.Region{{Addr: memory.AddrOf(dst), Len: 4096}, {Addr: memory.AddrOf(dst[4096:]), Len: 4096}}))
	rand.Read(src)
	frames, err = post(t, c, descs)
	require.NoError(t, err)
	require.Equal(t, 2, frames)
	require.Equal(t, src, dst)
}

// Digest mode's writes are marked with their descriptors only for a target
// that digests them as they land; for one that digests at sync time they
// go as plain writes, consecutive descriptors joined.
func TestMarkedWritesJoinOnlyWithoutLanding(t *testing.T) {
	src, dst := testmem.Pages(t, 4), testmem.Pages(t, 4)
	descs := make([]desc.Desc, 4)
	for i := range descs {
		descs[i] = desc.Desc{Src: memory.AddrOf(src[i*4096:]), Dst: memory.AddrOf(dst[i*4096:]), Len: 4096}
	}
	for _, landing := range []bool{false, true} {
		c := joinPair(t, src, dst, nil, nil, nil)
		c.landing = landing
		rand.Read(src)
		require.NoError(t, c.PostMarked(context.Background(), descs, 0))
		frames := len(c.owed)
		require.NoError(t, c.readOwed(context.Background()))
		require.Equal(t, src, dst)
		if landing {
			require.Equal(t, 4, frames, "one marked frame per descriptor")
		} else {
			require.Equal(t, 1, frames)
		}
	}
}
