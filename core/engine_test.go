package core

import (
	"bytes"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/core/desc"
	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/core/memory"
	"github.com/mcguard/mcguard/core/transport/engine"
	"github.com/mcguard/mcguard/verify"
)

// fakeEngines is an in-process transfer engine shared by every guard of a
// test, with Mooncake's rules: both ends of a transfer must be registered
// with the engine (locally, and at the peer it names), and a request is
// cut into slices that each may go astray (lose).
type fakeEngines struct {
	mu    sync.Mutex
	nodes map[string]map[uint64]uint64 // engine name -> registered regions
	// lose, if set, says whether one slice of a write is lost.
	lose func(off uint64) bool
	// loseRead, if set, says whether one slice of a read is lost.
	loseRead  func(off uint64) bool
	sliceSize uint64
	// slow, if set, is how long each write call takes at least.
	slow    time.Duration
	calls   int
	reads   atomic.Int64 // read calls
	written [][]uint64   // each write call's request lengths
}

func newFakeEngines() *fakeEngines {
	return &fakeEngines{nodes: map[string]map[uint64]uint64{}, sliceSize: 64 << 10}
}

func (f *fakeEngines) registered(node string, addr, n uint64) bool {
	for a, l := range f.nodes[node] {
		if addr >= a && addr+n <= a+l {
			return true
		}
	}
	return false
}

func (f *fakeEngines) register(node string, addr, n uint64) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.nodes[node] == nil {
		f.nodes[node] = map[uint64]uint64{}
	}
	f.nodes[node][addr] = n
	return nil
}

// ops is the engine as node sees it.
func (f *fakeEngines) ops(node, name string) engine.Ops {
	move := func(write bool) engine.Batch {
		return func(session string, local, remote, n []uint64) error {
			if write && f.slow > 0 {
				time.Sleep(f.slow)
			}
			f.mu.Lock()
			defer f.mu.Unlock()
			f.calls++
			if !write {
				f.reads.Add(1)
			} else {
				f.written = append(f.written, append([]uint64(nil), n...))
			}
			if _, ok := f.nodes[session]; !ok {
				return fmt.Errorf("no segment named %q", session)
			}
			for i := range n {
				if !f.registered(node, local[i], n[i]) || !f.registered(session, remote[i], n[i]) {
					return fmt.Errorf("descriptor %d: memory not registered with the engine", i)
				}
				src, dst := memory.BytesAt(local[i], n[i]), memory.BytesAt(remote[i], n[i])
				if !write {
					src, dst = dst, src
				}
				for off := uint64(0); off < n[i]; off += f.sliceSize {
					end := min(off+f.sliceSize, n[i])
					if write && f.lose != nil && f.lose(off) || !write && f.loseRead != nil && f.loseRead(off) {
						continue
					}
					copy(dst[off:end], src[off:end])
				}
			}
			return nil
		}
	}
	return engine.Ops{Name: name, Write: move(true), Read: move(false),
		Register: func(addr, n uint64) error { return f.register(node, addr, n) },
		Unregister: func(addr uint64) error {
			f.mu.Lock()
			defer f.mu.Unlock()
			delete(f.nodes[node], addr)
			return nil
		}}
}

// newEnginePair is a sender over the fake engine (node "prefill") writing
// to node "decode" whose memory its guard, a plain one, registered too:
// the sender knows that guard as the peer's (SetPeerGuard).
func newEnginePair(t *testing.T, sendJS, recvJS string, size int, f *fakeEngines) *pair {
	p := &pair{src: newMem(t, size), dst: newMem(t, size), session: "decode:1"}
	g, err := OpenWithEngine(testConfig(t, sendJS), f.ops("prefill", "fake"))
	require.NoError(t, err)
	t.Cleanup(func() { g.Close() })
	p.send, p.recv = g, openGuard(t, recvJS)
	require.NoError(t, p.send.Register(p.src.addr(0), uint64(size)))
	require.NoError(t, p.recv.Register(p.dst.addr(0), uint64(size)))
	require.NoError(t, f.register(p.session, p.dst.addr(0), uint64(size)))
	require.NoError(t, p.send.SetPeerGuard(p.session, p.recv.Endpoint()))
	return p
}

func TestEngineMovesAndVerifiesInEveryMode(t *testing.T) {
	f := newFakeEngines()
	p := newEnginePair(t, `{"verify": "tail"}`, "", 64*4096, f)
	require.True(t, f.registered("prefill", p.src.addr(0), 64*4096), "the guard registered its source with the engine")
	p.moveInEveryMode(t, 64, 4096)
	st := stats(t, p.send)
	require.Equal(t, "engine", st["transport"])
	require.EqualValues(t, 1, st["notices_sent"])
}

func TestEngineReadBacksLandInRegisteredScratch(t *testing.T) {
	f := newFakeEngines()
	p := newEnginePair(t, `{"verify": "full", "engine_peer_checks": false}`, "", 1<<20, f)
	fill(p.src.b)
	_, err := p.send.Transfer(p.session, p.blocks(1, 1<<20), TransferOptions{})
	require.NoError(t, err, "the fake engine refuses reads into memory not registered with it")
	f.mu.Lock()
	regions := len(f.nodes["prefill"])
	f.mu.Unlock()
	require.Equal(t, 2, regions, "the source and the session's scratch")
	require.NoError(t, p.send.Close())
	f.mu.Lock()
	defer f.mu.Unlock()
	require.Len(t, f.nodes["prefill"], 1, "closing the session let the scratch go")
}

// Where the peer's guard is known, the read-backs are its answers over
// mcguard's own connection, and digest notices go there too: nothing is
// read through the engine, and no scratch is registered with it, in any
// mode. An application's own read still goes through the engine.
func TestEngineChecksGoThroughThePeersGuard(t *testing.T) {
	f := newFakeEngines()
	p := newEnginePair(t, `{"verify": "tail"}`, "", 64*4096, f)
	p.moveInEveryMode(t, 64, 4096)
	require.Zero(t, f.reads.Load(), "no read-back went through the engine")
	f.mu.Lock()
	require.Len(t, f.nodes["prefill"], 1, "no read-back scratch registered with the engine")
	f.mu.Unlock()
	st := stats(t, p.send)
	require.EqualValues(t, 1, st["peer_checked"])
	require.EqualValues(t, 0, st["peer_check_fallbacks"])
	require.EqualValues(t, 1, stats(t, p.recv)["notices_received"], "the digest notice")

	require.NoError(t, p.send.Read(p.session, p.blocks(1, 4096)))
	require.EqualValues(t, 1, f.reads.Load(), "an application's read is the engine's")

	// A peer guard that cannot be reached: the engine reads back, said once.
	q := newEnginePair(t, `{"verify": "tail", "connect_timeout_ms": 200}`, "", 4096, f)
	require.NoError(t, q.send.SetPeerGuard(q.session, "127.0.0.1:1"))
	fill(q.src.b)
	_, err := q.send.Transfer(q.session, q.blocks(1, 4096), TransferOptions{})
	require.NoError(t, err)
	require.EqualValues(t, 1, stats(t, q.send)["peer_check_fallbacks"])
}

func TestEngineSliceAwareTailCatchesALostSlice(t *testing.T) {
	f := newFakeEngines()
	f.lose = func(off uint64) bool { return off == 64<<10 } // every descriptor's second slice
	sendJS := `{"verify": "tail", "max_retries": 2, "retry_sleep_s": 0.001}`
	p := newEnginePair(t, sendJS, "", 4*(256<<10), f)
	fill(p.src.b)
	_, err := p.send.Transfer(p.session, p.blocks(4, 256<<10), TransferOptions{})
	require.NoError(t, err, "an engine whose slice size mcguard does not know: the descriptors' tails arrived")
	require.False(t, bytes.Equal(p.src.b, p.dst.b), "and the bytes are wrong: why slice_bytes exists")

	g, err := OpenWithEngine(testConfig(t, sendJS), f.ops("prefill2", "mooncake"))
	require.NoError(t, err)
	defer g.Close()
	require.Equal(t, 64<<10, g.Config().Verify.SliceBytes, "over Mooncake: its slice size")
	require.NoError(t, g.Register(p.src.addr(0), uint64(len(p.src.b))))
	fill(p.src.b)
	_, err = g.Transfer(p.session, p.blocks(4, 256<<10), TransferOptions{})
	require.ErrorIs(t, err, errs.Verify, "every slice's tail is checked")
	require.Contains(t, err.Error(), "4 descriptor(s)")
}

func TestEngineSliceBytesFollowsMooncake(t *testing.T) {
	env := func(v string) func(string) string { return func(string) string { return v } }
	require.Equal(t, 65536, engineSliceBytes("mooncake", env("")))
	require.Equal(t, 131072, engineSliceBytes("Mooncake", env("131072")))
	require.Equal(t, 64, engineSliceBytes("mooncake", env(" 64k")), "atoi reads up to the first non-digit")
	require.Equal(t, 65536, engineSliceBytes("mooncake", env("0")), "not positive: Mooncake keeps 64 KiB")
	require.Equal(t, 65536, engineSliceBytes("mooncake", env("lots")))
	require.Equal(t, 0, engineSliceBytes("nixl", env("131072")), "another engine: whole descriptors")
	cfg := testConfig(t, `{"slice_bytes": 4096}`)
	g, err := OpenWithEngine(cfg, newFakeEngines().ops("x", "mooncake"))
	require.NoError(t, err)
	defer g.Close()
	require.Equal(t, 4096, g.Config().Verify.SliceBytes, "a setting wins")
}

func TestEngineDigestNeedsThePeersGuardOrForwardedDigests(t *testing.T) {
	f := newFakeEngines()
	p := newEnginePair(t, `{"verify": "digest"}`, "", 8*4096, f)
	g, err := OpenWithEngine(testConfig(t, `{"verify": "digest"}`), f.ops("lone", "fake"))
	require.NoError(t, err)
	defer g.Close()
	require.NoError(t, g.Register(p.src.addr(0), uint64(len(p.src.b))))
	fill(p.src.b)
	_, err = g.Transfer(p.session, p.blocks(8, 4096), TransferOptions{})
	require.ErrorIs(t, err, errs.Config)
	require.Contains(t, err.Error(), "mc_guard_set_peer_guard")

	digests := make([]uint64, 8)
	_, err = g.Transfer(p.session, p.blocks(8, 4096), TransferOptions{NoNotice: true, Digests: digests})
	require.NoError(t, err, "the application forwards the digests itself")
	ranges := make([]SyncRange, 8)
	for i, d := range p.blocks(8, 4096) {
		ranges[i] = SyncRange{d.Dst, d.Len}
	}
	require.NoError(t, p.recv.Sync(ranges, digests, 0))
	require.True(t, bytes.Equal(p.src.b, p.dst.b))
}

func TestEngineErrorsAreReportedWithTheEnginesMessage(t *testing.T) {
	f := newFakeEngines()
	p := newEnginePair(t, `{"verify": "tail"}`, "", 4096, f)
	res, err := p.send.Transfer("nobody:9", p.blocks(1, 4096), TransferOptions{})
	require.Error(t, err)
	require.Contains(t, err.Error(), `no segment named "nobody:9"`)
	require.Equal(t, AbortUnconfirmed, res.Abort, "the engine's writes pass no guard that could confirm an abort")
	_, err = p.send.Transfer(p.session, []desc.Desc{{Src: p.src.addr(0), Dst: p.dst.addr(0) + 8192, Len: 64}}, TransferOptions{})
	require.Error(t, err)
	require.Contains(t, err.Error(), "not registered with the engine")
	err = p.send.Quiesce([]SyncRange{{p.src.addr(0), 64}})
	require.Error(t, err)
	require.Contains(t, err.Error(), "quiesce is not available at the receiver over an engine")
	require.ErrorIs(t, p.recv.SetPeerGuard("a:1", "b:2"), errs.InvalidArg, "only for guards over an engine")
}

func TestEngineHungCallEndsAtTheDeadline(t *testing.T) {
	f := newFakeEngines()
	release, finished := make(chan struct{}), make(chan struct{})
	ops := f.ops("prefill", "fake")
	write := ops.Write
	ops.Write = func(session string, local, remote, n []uint64) error {
		<-release
		defer close(finished)
		return write(session, local, remote, n)
	}
	g, err := OpenWithEngine(testConfig(t, `{"timeout_ms": 300}`), ops)
	require.NoError(t, err)
	m := newMem(t, 4096)
	require.NoError(t, g.Register(m.addr(0), 4096))
	require.NoError(t, f.register("decode:1", m.addr(0), 4096))
	start := time.Now()
	_, err = g.Transfer("decode:1", []desc.Desc{{Src: m.addr(0), Dst: m.addr(0), Len: 64}}, TransferOptions{Deadline: 100 * time.Millisecond})
	require.ErrorIs(t, err, errs.Timeout)
	require.Contains(t, err.Error(), "may still land")
	require.Less(t, time.Since(start), 2*time.Second)
	require.EqualValues(t, 1, stats(t, g)["engine_calls_in_flight"], "the abandoned call: its blocks are not safe to reuse yet")
	start = time.Now()
	require.NoError(t, g.Close(), "close waits for the engine call at most its linger time")
	require.Less(t, time.Since(start), 2*time.Second)
	close(release)
	<-finished // the abandoned call still writes: the memory must outlive it
	require.Eventually(t, func() bool { return g.engine.InFlight() == 0 }, 2*time.Second, time.Millisecond)
}

func TestWaitEngineCallsWaitsForItsTransferOnly(t *testing.T) {
	f := newFakeEngines()
	held := map[string]chan struct{}{"decode:1": make(chan struct{}), "decode:2": make(chan struct{})}
	entered := make(chan string, 2)
	ops := f.ops("prefill", "fake")
	write := ops.Write
	ops.Write = func(session string, local, remote, n []uint64) error {
		entered <- session
		<-held[session]
		return write(session, local, remote, n)
	}
	g, err := OpenWithEngine(testConfig(t, `{"verify": "tail"}`), ops)
	require.NoError(t, err)
	defer g.Close()
	m := newMem(t, 8192)
	require.NoError(t, g.Register(m.addr(0), 8192))
	require.NoError(t, f.register("decode:1", m.addr(0), 4096))
	require.NoError(t, f.register("decode:2", m.addr(4096), 4096))

	// Transfer A gives up at its deadline with its write still in the
	// engine; transfer B, to another session, is still in its write.
	a, err := g.Transfer("decode:1", []desc.Desc{{Src: m.addr(0), Dst: m.addr(0), Len: 64}}, TransferOptions{Deadline: 100 * time.Millisecond})
	require.ErrorIs(t, err, errs.Timeout)
	require.NotZero(t, a.ID, "a failed transfer has an id to wait on")
	require.Equal(t, "decode:1", <-entered)
	bDone := make(chan error, 1)
	go func() {
		_, err := g.Transfer("decode:2", []desc.Desc{{Src: m.addr(4096), Dst: m.addr(4096), Len: 64}}, TransferOptions{})
		bDone <- err
	}()
	require.Equal(t, "decode:2", <-entered)
	require.EqualValues(t, 2, g.engine.InFlight())

	err = g.WaitEngineCalls(a.ID, 0)
	require.ErrorIs(t, err, errs.Timeout, "A's write is still in the engine")
	require.Contains(t, err.Error(), "1 engine call(s)")
	start := time.Now()
	require.ErrorIs(t, g.WaitEngineCalls(a.ID, 50*time.Millisecond), errs.Timeout)
	require.GreaterOrEqual(t, time.Since(start), 50*time.Millisecond)

	close(held["decode:1"])
	require.NoError(t, g.WaitEngineCalls(a.ID, 5*time.Second), "A's call returned; B's, still running, is not A's")
	require.EqualValues(t, 1, g.engine.InFlight(), "B is still in the engine")
	close(held["decode:2"])
	require.NoError(t, <-bDone)
	require.Eventually(t, func() bool { return g.engine.InFlight() == 0 }, 2*time.Second, time.Millisecond)
	require.NoError(t, g.WaitEngineCalls(a.ID, 0), "nothing of A runs: at once")
	require.Zero(t, g.engine.(*engine.Plane).Transfers(), "no entry outlives its calls")

	for _, bad := range []struct {
		id      uint64
		timeout time.Duration
		why     string
	}{
		{0, 0, "not given by this guard"},
		{a.ID + 1000, 0, "not given by this guard"},
		{g.ids.permute(g.ids.next.Load() + 1), 0, "not given by this guard"},
		{a.ID, -time.Second, "outside"},
		{a.ID, 25 * time.Hour, "outside"},
	} {
		err := g.WaitEngineCalls(bad.id, bad.timeout)
		require.ErrorIs(t, err, errs.InvalidArg, bad.why)
		require.Contains(t, err.Error(), bad.why)
	}
	plain := openGuard(t, "")
	err = plain.WaitEngineCalls(1, 0)
	require.ErrorIs(t, err, errs.InvalidArg)
	require.Contains(t, err.Error(), "abort state")
}

func TestEngineHeldWritesCountForTheirTransfer(t *testing.T) {
	f := newFakeEngines()
	g, err := OpenWithEngine(testConfig(t, `{"verify": "off", "inject": "hold", "inject_rate": 1, "inject_lag_max_ms": 1000}`), f.ops("prefill", "fake"))
	require.NoError(t, err)
	defer g.Close()
	m := newMem(t, 4096)
	require.NoError(t, g.Register(m.addr(0), 4096))
	require.NoError(t, f.register("decode:1", m.addr(0), 4096))
	var ids []uint64
	for range 20 {
		res, err := g.Transfer("decode:1", []desc.Desc{{Src: m.addr(0), Dst: m.addr(0), Len: 64}}, TransferOptions{})
		require.NoError(t, err, "off trusts the engine: the held write is not seen")
		ids = append(ids, res.ID)
	}
	require.Equal(t, 20, g.engine.(*engine.Plane).Transfers(), "one entry per transfer with a write held")
	for _, id := range ids {
		require.ErrorIs(t, g.WaitEngineCalls(id, 0), errs.Timeout, "its write is held")
	}
	for _, id := range ids {
		require.NoError(t, g.WaitEngineCalls(id, 5*time.Second))
	}
	require.EqualValues(t, 0, g.engine.InFlight())
	require.Zero(t, g.engine.(*engine.Plane).Transfers(), "the entries went with their calls")
}

func TestWaitEngineCallsEndsWhenTheGuardCloses(t *testing.T) {
	f := newFakeEngines()
	g, err := OpenWithEngine(testConfig(t, `{"verify": "off", "inject": "hold", "inject_rate": 1, "inject_lag_max_ms": 5000, "timeout_ms": 300}`), f.ops("prefill", "fake"))
	require.NoError(t, err)
	m := newMem(t, 4096)
	require.NoError(t, g.Register(m.addr(0), 4096))
	require.NoError(t, f.register("decode:1", m.addr(0), 4096))
	res, err := g.Transfer("decode:1", []desc.Desc{{Src: m.addr(0), Dst: m.addr(0), Len: 64}}, TransferOptions{})
	require.NoError(t, err)
	waited, started := make(chan error, 1), make(chan struct{})
	go func() {
		close(started)
		waited <- g.WaitEngineCalls(res.ID, time.Hour)
	}()
	<-started
	time.Sleep(50 * time.Millisecond) // let it wait
	start := time.Now()
	require.NoError(t, g.Close())
	err = <-waited
	require.ErrorIs(t, err, errs.Closed, "a close ends the wait, whose write is still held")
	require.Contains(t, err.Error(), "while waiting for the engine calls", "the wait began before the close")
	require.Less(t, time.Since(start), 3*time.Second, "close waits for the held write at most its linger time")
}

func TestOpenWithEngineRefusesBadSettings(t *testing.T) {
	f := newFakeEngines()
	for js, want := range map[string]error{
		`{"transport": "tcp"}`:   errs.Config,
		`{"require_rdma": true}`: errs.Config,
		`{"inject": "stale"}`:    errs.Config,
	} {
		_, err := OpenWithEngine(testConfig(t, js), f.ops("x", "fake"))
		require.ErrorIs(t, err, want, js)
	}
	ops := f.ops("x", "fake")
	ops.Read = nil
	_, err := OpenWithEngine(testConfig(t, ""), ops)
	require.ErrorIs(t, err, errs.Config)
	require.Contains(t, err.Error(), "needs both a write and a read callback")
	g, err := Open(testConfig(t, `{"transport": "auto"}`))
	require.NoError(t, err, "auto never picks the engine")
	require.NotEqual(t, "engine", stats(t, g)["transport"])
	g.Close()
}

// A transfer with no deadline of its own still gives up on an engine call
// at timeout_ms: a write callback that sleeps 3 s returned MC_OK after
// 3 s. The late call's result is dropped, it counts as in flight until it
// returns, and a cancel ends the transfer at once, not after the engine.
func TestEngineCallEndsAtTimeoutAndCancelAtOnce(t *testing.T) {
	f := newFakeEngines()
	entered, release, finished := make(chan struct{}, 2), make(chan struct{}), make(chan struct{}, 2)
	ops := f.ops("prefill", "fake")
	write := ops.Write
	ops.Write = func(session string, local, remote, n []uint64) error {
		entered <- struct{}{}
		defer func() { finished <- struct{}{} }()
		<-release
		return write(session, local, remote, n)
	}
	g, err := OpenWithEngine(testConfig(t, `{"timeout_ms": 300}`), ops)
	require.NoError(t, err)
	defer g.Close()
	m := newMem(t, 4096)
	require.NoError(t, g.Register(m.addr(0), 4096))
	require.NoError(t, f.register("decode:1", m.addr(0), 4096))
	descs := []desc.Desc{{Src: m.addr(0), Dst: m.addr(0), Len: 64}}

	start := time.Now()
	res, err := g.Transfer("decode:1", descs, TransferOptions{})
	took := time.Since(start)
	require.ErrorIs(t, err, errs.Timeout)
	require.Contains(t, err.Error(), "timeout_ms")
	require.GreaterOrEqual(t, took, 300*time.Millisecond)
	require.Less(t, took, 2*time.Second, "at timeout_ms, not when the engine returns")
	require.ErrorIs(t, g.WaitEngineCalls(res.ID, 0), errs.Timeout, "the abandoned call still runs")

	done := make(chan error, 1)
	go func() {
		_, err := g.Transfer("decode:1", descs, TransferOptions{})
		done <- err
	}()
	<-entered
	<-entered
	start = time.Now()
	require.NoError(t, g.Cancel("decode:1"))
	require.ErrorIs(t, <-done, errs.Cancelled)
	require.Less(t, time.Since(start), time.Second, "a cancel does not wait for the engine")
	close(release)
	<-finished
	<-finished
	require.NoError(t, g.WaitEngineCalls(res.ID, 2*time.Second))
}

// With engine_inline_calls the callback runs on the caller's thread: a
// call that returns past timeout_ms fails then, never reports success.
func TestEngineInlineCallPastItsDeadlineFails(t *testing.T) {
	f := newFakeEngines()
	ops := f.ops("prefill", "fake")
	write := ops.Write
	ops.Write = func(session string, local, remote, n []uint64) error {
		time.Sleep(400 * time.Millisecond)
		return write(session, local, remote, n)
	}
	g, err := OpenWithEngine(testConfig(t, `{"timeout_ms": 200, "engine_inline_calls": true}`), ops)
	require.NoError(t, err)
	defer g.Close()
	require.Equal(t, true, stats(t, g)["engine_inline_calls"])
	m := newMem(t, 4096)
	require.NoError(t, g.Register(m.addr(0), 4096))
	require.NoError(t, f.register("decode:1", m.addr(0), 4096))
	start := time.Now()
	_, err = g.Transfer("decode:1", []desc.Desc{{Src: m.addr(0), Dst: m.addr(0), Len: 64}}, TransferOptions{})
	require.ErrorIs(t, err, errs.Timeout)
	require.GreaterOrEqual(t, time.Since(start), 400*time.Millisecond, "inline: once the callback returned")
	require.Zero(t, g.engine.InFlight())
}

// An engine that keeps writes to itself and answers reads of them from
// its own copy (inject "lie") passes every read-back: they trust the
// engine's read path. Digest mode, compared by the receiver's guard in
// the receiver's memory, does not.
func TestALyingEngineFoolsReadBacksAndNotTheReceiversDigest(t *testing.T) {
	f := newFakeEngines()
	p := newEnginePair(t, `{"inject": "lie", "inject_rate": 1, "engine_peer_checks": false}`, "", 8*4096, f)
	for _, mode := range []verify.Mode{verify.Tail, verify.Sample, verify.Full} {
		fill(p.src.b)
		_, err := p.send.Transfer(p.session, p.blocks(8, 4096), TransferOptions{Verify: ptr(mode)})
		require.NoError(t, err, "%s trusts what the engine reads back", mode)
		require.False(t, bytes.Equal(p.src.b, p.dst.b), "%s: and the receiver never got the bytes", mode)
	}
	// Read back through the peer's guard (the default where it is known),
	// the lie is seen in every read-back mode.
	q := newEnginePair(t, `{"inject": "lie", "inject_rate": 1, "max_retries": 1, "retry_sleep_s": 0.001}`, "", 8*4096, f)
	for _, mode := range []verify.Mode{verify.Tail, verify.Sample, verify.Full} {
		fill(q.src.b)
		_, err := q.send.Transfer(q.session, q.blocks(8, 4096), TransferOptions{Verify: ptr(mode)})
		require.ErrorIs(t, err, errs.Verify, "%s: the peer's guard read what landed", mode)
	}
	fill(p.src.b)
	res, err := p.send.Transfer(p.session, p.blocks(8, 4096), TransferOptions{Verify: ptr(verify.Digest)})
	require.NoError(t, err)
	err = p.recv.SyncTransfers([]uint64{res.ID}, 0)
	require.ErrorIs(t, err, errs.Verify, "the receiver's digests see the missing bytes")

	_, err = Open(testConfig(t, `{"inject": "lie"}`))
	require.ErrorIs(t, err, errs.Config, "lie is an engine's fault")
}

// A receiver over an engine quiesces at the sender (QuiesceEngine): a
// write of a transfer begun before, held back, never reaches the engine;
// the quiesce returns only once that held call is over; a later
// transfer into the range goes through; nothing is left behind.
func TestQuiesceEngineKeepsAHeldWriteOutOfTheQuiescedRange(t *testing.T) {
	f := newFakeEngines()
	g, err := OpenWithEngine(testConfig(t, `{"verify": "off", "inject": "hold", "inject_rate": 1, "inject_lag_max_ms": 600}`), f.ops("prefill", "fake"))
	require.NoError(t, err)
	defer g.Close()
	src, dst := newMem(t, 8192), newMem(t, 8192)
	require.NoError(t, g.Register(src.addr(0), 8192))
	require.NoError(t, f.register("decode:1", dst.addr(0), 8192))
	fill(src.b[:4096])
	old, err := g.Transfer("decode:1", []desc.Desc{{Src: src.addr(0), Dst: dst.addr(0), Len: 4096}}, TransferOptions{})
	require.NoError(t, err, "off trusts the engine: the held write is not seen")
	start := time.Now()
	require.NoError(t, g.QuiesceEngine("decode:1", []SyncRange{{Addr: dst.addr(0), Len: 4096}}))
	require.GreaterOrEqual(t, time.Since(start), 400*time.Millisecond, "it waited for the held call")
	require.NoError(t, g.WaitEngineCalls(old.ID, 0), "nothing of the old transfer runs any more")
	require.Equal(t, make([]byte, 4096), dst.b[:4096], "the held write never reached the engine")

	// Another session, and ranges outside the quiesce, are untouched; a
	// transfer begun after the quiesce writes the range.
	fill(src.b[4096:])
	g2, err := OpenWithEngine(testConfig(t, `{"verify": "off"}`), f.ops("prefill", "fake"))
	require.NoError(t, err)
	defer g2.Close()
	require.NoError(t, g2.Register(src.addr(0), 8192))
	require.NoError(t, g2.QuiesceEngine("decode:1", []SyncRange{{Addr: dst.addr(0), Len: 4096}}), "nothing runs: at once")
	_, err = g2.Transfer("decode:1", []desc.Desc{{Src: src.addr(4096), Dst: dst.addr(0), Len: 4096}}, TransferOptions{})
	require.NoError(t, err, "begun after the quiesce")
	require.Equal(t, src.b[4096:], dst.b[:4096])
	require.Zero(t, g.engine.(*engine.Plane).Sessions(), "no fence state is kept once nothing runs under it")
	require.Zero(t, g2.engine.(*engine.Plane).Sessions())
}

// stalledTransfer starts a transfer of two 4 KiB blocks to "decode:1"
// over an engine whose first write stalls until release is closed, and
// returns once that write has begun; done gets the transfer's result.
func stalledTransfer(t *testing.T, cfg string) (g *Guard, dst *mem, release chan struct{}, done chan error) {
	f := newFakeEngines()
	ops := f.ops("prefill", "fake")
	write, first := ops.Write, make(chan struct{})
	release = make(chan struct{})
	var once sync.Once
	ops.Write = func(session string, local, remote, n []uint64) error {
		once.Do(func() { close(first); <-release })
		return write(session, local, remote, n)
	}
	src := newMem(t, 8192) // first: cleanups run last-in first-out, the guard closes before these go
	dst = newMem(t, 8192)
	g, err := OpenWithEngine(testConfig(t, cfg), ops)
	require.NoError(t, err)
	t.Cleanup(func() { g.Close() })
	fill(src.b)
	require.NoError(t, g.Register(src.addr(0), 8192))
	require.NoError(t, f.register("decode:1", dst.addr(0), 8192))
	done = make(chan error, 1)
	go func() {
		_, err := g.Transfer("decode:1", []desc.Desc{{Src: src.addr(0), Dst: dst.addr(0), Len: 4096},
			{Src: src.addr(4096), Dst: dst.addr(4096), Len: 4096}}, TransferOptions{})
		done <- err
	}()
	<-first
	return g, dst, release, done
}

// A transfer under way when the quiesce comes fails at its next engine
// write into the range with ErrQuiesced, instead of writing there.
func TestQuiesceEngineFailsATransferUnderWay(t *testing.T) {
	g, dst, release, done := stalledTransfer(t, `{"verify": "off", "max_batch": 1}`)
	quiesced := make(chan error, 1)
	go func() { quiesced <- g.QuiesceEngine("decode:1", []SyncRange{{Addr: dst.addr(4096), Len: 4096}}) }()
	select {
	case <-quiesced:
		t.Fatal("the quiesce returned while a call of the transfer still ran")
	case <-time.After(100 * time.Millisecond):
	}
	close(release)
	require.NoError(t, <-quiesced)
	require.ErrorIs(t, <-done, errs.Quiesced, "its second write is into the quiesced range")
	require.Equal(t, make([]byte, 4096), dst.b[4096:], "and never reached the engine")
}

// A quiesce that a call of an earlier transfer outlasts fails at
// sync_timeout, saying how many such calls still run; the call's
// transfer still never writes into the range afterwards.
func TestQuiesceEngineOutlastedByACallSaysHowMany(t *testing.T) {
	g, dst, release, done := stalledTransfer(t, `{"verify": "off", "max_batch": 1, "sync_timeout_ms": 100}`)
	err := g.QuiesceEngine("decode:1", []SyncRange{{Addr: dst.addr(4096), Len: 4096}})
	require.ErrorIs(t, err, errs.Timeout)
	require.Contains(t, err.Error(), "1 engine call(s) to decode:1 that began before the quiesce still running")
	close(release)
	require.ErrorIs(t, <-done, errs.Quiesced)
	require.Equal(t, make([]byte, 4096), dst.b[4096:])
	require.Zero(t, g.engine.(*engine.Plane).Sessions(), "nothing kept once the call returned")
}

func TestQuiesceEngineRefusesBadInput(t *testing.T) {
	f := newFakeEngines()
	g, err := OpenWithEngine(testConfig(t, `{"verify": "off"}`), f.ops("prefill", "fake"))
	require.NoError(t, err)
	defer g.Close()
	for _, bad := range []struct {
		session string
		ranges  []SyncRange
	}{{"", []SyncRange{{Addr: 4096, Len: 1}}}, {"decode:1", nil}, {"decode:1", []SyncRange{{Addr: 4096, Len: 0}}},
		{"decode:1", []SyncRange{{Addr: ^uint64(0), Len: 2}}}} {
		require.ErrorIs(t, g.QuiesceEngine(bad.session, bad.ranges), errs.InvalidArg, "%+v", bad)
	}
	plain := openGuard(t, `{}`)
	require.ErrorIs(t, plain.QuiesceEngine("x:1", []SyncRange{{Addr: 4096, Len: 1}}), errs.InvalidArg, "not over an engine")
}
