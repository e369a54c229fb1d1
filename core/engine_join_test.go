package core

import (
	"bytes"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/core/errs"
)

// newJoinPair is newEnginePair over an engine named "mooncake" (whose
// slice size, 64 KiB, the guard knows), with the receiver's memory
// registered, with its guard and with the engine, as regions starting at
// the offsets cuts (and the sender's the same way).
func newJoinPair(t *testing.T, sendJS string, size int, cuts []int, f *fakeEngines) *pair {
	p := &pair{src: newMem(t, size), dst: newMem(t, size), session: "decode:1"}
	g, err := OpenWithEngine(testConfig(t, sendJS), f.ops("prefill", "mooncake"))
	require.NoError(t, err)
	t.Cleanup(func() { g.Close() })
	p.send, p.recv = g, openGuard(t, "")
	bounds := append(append([]int{0}, cuts...), size)
	for i := 0; i+1 < len(bounds); i++ {
		off, n := bounds[i], uint64(bounds[i+1]-bounds[i])
		require.NoError(t, p.send.Register(p.src.addr(off), n))
		require.NoError(t, p.recv.Register(p.dst.addr(off), n))
		require.NoError(t, f.register(p.session, p.dst.addr(off), n))
	}
	require.NoError(t, p.send.SetPeerGuard(p.session, p.recv.Endpoint()))
	return p
}

// writesSince is the request lengths of the engine's write calls after
// the first from.
func (f *fakeEngines) writesSince(from int) [][]uint64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([][]uint64(nil), f.written[from:]...)
}

func (f *fakeEngines) writeCalls() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.written)
}

// Over Mooncake with the peer's guard known, a cache's consecutive
// blocks go as requests of one Mooncake slice (64 KiB) each, inside the
// registered regions at both ends, in every mode; blocks that do not
// continue one another go one by one.
func TestEngineJoinsConsecutiveBlocksIntoSlices(t *testing.T) {
	f := newFakeEngines()
	p := newJoinPair(t, `{"verify": "tail"}`, 64*4096, nil, f)
	from := f.writeCalls()
	p.moveInEveryMode(t, 64, 4096)
	writes := f.writesSince(from)
	require.Len(t, writes, 5, "one write call per mode")
	for _, w := range writes {
		require.Equal(t, []uint64{64 << 10, 64 << 10, 64 << 10, 64 << 10}, w, "64 blocks of 4 KiB: four slices")
	}
	require.EqualValues(t, 5*60, stats(t, p.send)["joined_descriptors"])

	// Backwards: nothing continues.
	fill(p.src.b)
	d := p.blocks(64, 4096)
	for i, j := 0, len(d)-1; i < j; i, j = i+1, j-1 {
		d[i], d[j] = d[j], d[i]
	}
	from = f.writeCalls()
	_, err := p.send.Transfer(p.session, d, TransferOptions{})
	require.NoError(t, err)
	require.True(t, bytes.Equal(p.src.b, p.dst.b))
	w := f.writesSince(from)
	require.Len(t, w, 1)
	require.Len(t, w[0], 64, "one request per block")

	// Blocks larger than half a slice: each its own request, whole.
	fill(p.src.b)
	from = f.writeCalls()
	_, err = p.send.Transfer(p.session, p.blocks(4, 48<<10), TransferOptions{})
	require.NoError(t, err)
	require.Equal(t, [][]uint64{{48 << 10, 48 << 10, 48 << 10, 48 << 10}}, f.writesSince(from))
	require.True(t, bytes.Equal(p.src.b[:4*48<<10], p.dst.b[:4*48<<10]))
}

// A joined request never runs from one registered region into the next,
// at the receiver (the peer guard's table) or here: the engine would
// refuse it (the fake, as Mooncake, wants each request inside one).
func TestEngineJoinsStayInsideRegions(t *testing.T) {
	f := newFakeEngines()
	const size = 64 * 4096
	p := newJoinPair(t, `{"verify": "tail"}`, size, []int{40 << 10, 200 << 10}, f)
	from := f.writeCalls()
	p.moveInEveryMode(t, 64, 4096)
	writes := f.writesSince(from)
	require.Len(t, writes, 5, "one write call per mode")
	for _, w := range writes {
		require.Equal(t, []uint64{40 << 10, 64 << 10, 64 << 10, 32 << 10, 56 << 10}, w)
	}
}

// A joined request is one of the engine's slices, whose tail is its last
// block's: a request the engine lost is caught by tail (all 16 of its
// blocks), and written again where on_mismatch says so.
func TestEngineTailCatchesALostJoinedRequest(t *testing.T) {
	for _, resend := range []bool{false, true} {
		f := newFakeEngines()
		lost := 0
		f.lose = func(off uint64) bool { // the engine's second slice written, once
			lost++
			return lost == 2
		}
		sendJS := `{"verify": "tail", "max_retries": 2, "retry_sleep_s": 0.001}`
		if resend {
			sendJS = `{"verify": "tail", "max_retries": 2, "retry_sleep_s": 0.001, "on_mismatch": "resend"}`
		}
		p := newJoinPair(t, sendJS, 64*4096, nil, f)
		fill(p.src.b)
		res, err := p.send.Transfer(p.session, p.blocks(64, 4096), TransferOptions{})
		if !resend {
			require.ErrorIs(t, err, errs.Verify)
			require.Contains(t, err.Error(), "16 descriptor(s)")
			require.Contains(t, err.Error(), "[16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31]")
			continue
		}
		require.NoError(t, err)
		require.Equal(t, 1, res.Resends, "the lost request's blocks were written again")
		require.True(t, bytes.Equal(p.src.b, p.dst.b))
	}
}

// Without the peer's guard (no table of its regions), or over an engine
// whose slice size is unknown, nothing is joined.
func TestEngineJoinsOnlyWithThePeersTableAndTheEnginesSlice(t *testing.T) {
	f := newFakeEngines()
	p := newEnginePair(t, `{"verify": "tail"}`, "", 64*4096, f) // an engine named "fake"
	from := f.writeCalls()
	fill(p.src.b)
	_, err := p.send.Transfer(p.session, p.blocks(64, 4096), TransferOptions{})
	require.NoError(t, err)
	require.True(t, bytes.Equal(p.src.b, p.dst.b))
	require.Len(t, f.writesSince(from)[0], 64)

	g, err := OpenWithEngine(testConfig(t, `{"verify": "tail"}`), f.ops("prefill3", "mooncake"))
	require.NoError(t, err)
	defer g.Close()
	require.NoError(t, g.Register(p.src.addr(0), uint64(len(p.src.b))))
	fill(p.src.b)
	from = f.writeCalls()
	_, err = g.Transfer(p.session, p.blocks(64, 4096), TransferOptions{}) // no SetPeerGuard
	require.NoError(t, err)
	require.True(t, bytes.Equal(p.src.b, p.dst.b))
	require.Len(t, f.writesSince(from)[0], 64)
	require.EqualValues(t, 0, stats(t, g)["joined_descriptors"])
}

// A receiver that splits a region after the sender learned its table can
// make one joined request run across the new boundary, which the engine
// refuses: that transfer fails (never a success), the session shakes
// hands again, and the next one joins within the new table.
func TestEngineJoinsFollowARegionSplitAfterOneFailure(t *testing.T) {
	f := newFakeEngines()
	const size = 64 * 4096
	p := newJoinPair(t, `{"verify": "tail"}`, size, nil, f)
	fill(p.src.b)
	_, err := p.send.Transfer(p.session, p.blocks(64, 4096), TransferOptions{})
	require.NoError(t, err)

	// The receiver's region becomes two, cut at 40 KiB, with its guard and the engine.
	require.NoError(t, p.recv.Unregister(p.dst.addr(0)))
	f.mu.Lock()
	delete(f.nodes[p.session], p.dst.addr(0))
	f.mu.Unlock()
	for _, r := range [][2]int{{0, 40 << 10}, {40 << 10, size}} {
		require.NoError(t, p.recv.Register(p.dst.addr(r[0]), uint64(r[1]-r[0])))
		require.NoError(t, f.register(p.session, p.dst.addr(r[0]), uint64(r[1]-r[0])))
	}
	fill(p.src.b)
	_, err = p.send.Transfer(p.session, p.blocks(64, 4096), TransferOptions{})
	require.ErrorContains(t, err, "not registered with the engine", "the engine refused a request across the receiver's new boundary")

	from := f.writeCalls()
	fill(p.src.b)
	_, err = p.send.Transfer(p.session, p.blocks(64, 4096), TransferOptions{})
	require.NoError(t, err)
	require.True(t, bytes.Equal(p.src.b, p.dst.b))
	require.Equal(t, [][]uint64{{40 << 10, 64 << 10, 64 << 10, 64 << 10, 24 << 10}}, f.writesSince(from))
}
