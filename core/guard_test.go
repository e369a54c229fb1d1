package core

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"runtime"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/mcguard/mcguard/core/desc"
	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/core/internal/testmem"

	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/core/memory"
	"github.com/mcguard/mcguard/core/transport/tcp"
	"github.com/mcguard/mcguard/verify"
)

// mem is memory outside the Go heap, as an application's buffers are.
type mem struct {
	b []byte
}

func newMem(t testing.TB, n int) *mem {
	t.Helper()
	return &mem{b: testmem.Map(t, n)}
}

func (m *mem) addr(off int) uint64 { return uint64(uintptr(unsafe.Pointer(&m.b[off]))) }

func testConfig(t *testing.T, js string) Config {
	t.Helper()
	c, err := LoadConfig(nil, js)
	require.NoError(t, err)
	return c
}

func openGuard(t *testing.T, js string) *Guard {
	t.Helper()
	g, err := Open(testConfig(t, js))
	require.NoError(t, err)
	t.Cleanup(func() { g.Close() })
	return g
}

// pair is a sender with a source region and a receiver with a destination.
type pair struct {
	send, recv *Guard
	src, dst   *mem
	session    string // the sender's name for the receiver
}

func newPair(t *testing.T, sendJS, recvJS string, size int) *pair {
	// Memory first: cleanups run last-in first-out, so the guards close
	// (and stop applying late writes) before the memory is unmapped.
	p := &pair{src: newMem(t, size), dst: newMem(t, size)}
	p.send, p.recv = openGuard(t, sendJS), openGuard(t, recvJS)
	require.NoError(t, p.send.Register(p.src.addr(0), uint64(size)))
	require.NoError(t, p.recv.Register(p.dst.addr(0), uint64(size)))
	p.session = p.recv.Endpoint()
	return p
}

// blocks returns n descriptors of size bytes each, src block i to dst block i.
func (p *pair) blocks(n, size int) []desc.Desc {
	d := make([]desc.Desc, n)
	for i := range d {
		d[i] = desc.Desc{Src: p.src.addr(i * size), Dst: p.dst.addr(i * size), Len: uint64(size)}
	}
	return d
}

// moveInEveryMode transfers n blocks of size bytes of fresh source bytes
// in each verification mode (digest: synced by the receiver), and checks
// that every destination byte arrived.
func (p *pair) moveInEveryMode(t *testing.T, n, size int) {
	t.Helper()
	for _, mode := range verify.Modes {
		fill(p.src.b)
		res, err := p.send.Transfer(p.session, p.blocks(n, size), TransferOptions{Verify: ptr(mode)})
		require.NoError(t, err, mode)
		if mode == verify.Digest {
			require.NoError(t, p.recv.SyncTransfers([]uint64{res.ID}, 0), "the receiver compares the digests")
		}
		require.True(t, bytes.Equal(p.src.b[:n*size], p.dst.b[:n*size]), mode)
	}
}

// transferer returns a transfer of descs to p's receiver, followed where
// sync is set by the receiver's sync of it, that allocates nothing of its
// own: for the allocation tests.
func (p *pair) transferer(t testing.TB, descs []desc.Desc, sync bool) func() {
	ids := make([]uint64, 1)
	return func() {
		res, err := p.send.Transfer(p.session, descs, TransferOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if sync {
			ids[0] = res.ID
			if err := p.recv.SyncTransfers(ids, 0); err != nil {
				t.Fatal(err)
			}
		}
	}
}

func fill(b []byte) { rand.Read(b) }

func TestTransferDeliversBytes(t *testing.T) {
	for _, mode := range []string{"off", "tail"} {
		t.Run(mode, func(t *testing.T) {
			p := newPair(t, fmt.Sprintf(`{"verify": %q}`, mode), "", 1<<20)
			fill(p.src.b)
			res, err := p.send.Transfer(p.recv.Endpoint(), p.blocks(16, 64<<10), TransferOptions{})
			require.NoError(t, err)
			require.NotZero(t, res.ID)
			require.True(t, bytes.Equal(p.src.b, p.dst.b), "destination equals source")
		})
	}
}

func TestTransferLargeDescriptorIsSliced(t *testing.T) {
	size := 9<<20 + 123 // over two wire slices, not a multiple of one
	p := newPair(t, "", "", size)
	fill(p.src.b)
	_, err := p.send.Transfer(p.recv.Endpoint(), []desc.Desc{{Src: p.src.addr(0), Dst: p.dst.addr(0), Len: uint64(size)}}, TransferOptions{})
	require.NoError(t, err)
	require.True(t, bytes.Equal(p.src.b, p.dst.b))
}

func TestTransferChunksAboveMaxBatch(t *testing.T) {
	const n, size = 1300, 256
	p := newPair(t, `{"max_batch": 512}`, "", n*size)
	fill(p.src.b)
	_, err := p.send.Transfer(p.recv.Endpoint(), p.blocks(n, size), TransferOptions{})
	require.NoError(t, err)
	require.True(t, bytes.Equal(p.src.b, p.dst.b))
	st := stats(t, p.send)
	require.EqualValues(t, n, st["descriptors"])
	require.EqualValues(t, n*64, st["probed_bytes"], "every descriptor's tail was read back once")
}

// dataAddr is the "host:port" of g's TCP target.
func dataAddr(g *Guard) string { return g.plane(tcp.Name).(*tcp.Transport).Addr() }

func stats(t *testing.T, g *Guard) map[string]any {
	b, err := g.Stats()
	require.NoError(t, err)
	var m map[string]any
	require.NoError(t, jsonUnmarshal(b, &m))
	return m
}

func TestLagIsFlushedByTheFenceAndMissedByOff(t *testing.T) {
	const n, size = 32, 4096
	recvJS := `{"inject": "lag", "inject_lag_max_ms": 30, "inject_seed": 7}`
	p := newPair(t, `{"verify": "off"}`, recvJS, n*size)
	fill(p.src.b)
	_, err := p.send.Transfer(p.recv.Endpoint(), p.blocks(n, size), TransferOptions{})
	require.NoError(t, err, "off trusts the acknowledgement")
	require.False(t, bytes.Equal(p.src.b, p.dst.b), "right after an off transfer under lag some bytes are not there yet")

	time.Sleep(50 * time.Millisecond)
	fill(p.src.b)
	res, err := p.send.Transfer(p.recv.Endpoint(), p.blocks(n, size), TransferOptions{Verify: ptr(verify.Tail)})
	require.NoError(t, err)
	require.True(t, bytes.Equal(p.src.b, p.dst.b), "tail verification returned only once every block landed")
	require.Zero(t, res.Retries, "the fence waited for the lagging writes: the first read-back matched")
}

func TestReorderIsCaughtByPolling(t *testing.T) {
	const n, size = 32, 4096
	p := newPair(t, "", `{"inject": "reorder", "inject_lag_max_ms": 20, "inject_seed": 3}`, n*size)
	fill(p.src.b)
	res, err := p.send.Transfer(p.recv.Endpoint(), p.blocks(n, size), TransferOptions{})
	require.NoError(t, err)
	require.True(t, bytes.Equal(p.src.b, p.dst.b))
	require.Positive(t, res.Retries, "a fence does not wait for reordered writes; polling does")
}

func TestFenceWaitsForEarlierWrites(t *testing.T) {
	const n, size = 16, 4096
	p := newPair(t, `{"verify": "off"}`, `{"inject": "lag", "inject_lag_max_ms": 40}`, n*size)
	fill(p.src.b)
	s := p.send.session(p.recv.Endpoint())
	_, err := p.send.Transfer(p.recv.Endpoint(), p.blocks(n, size), TransferOptions{})
	require.NoError(t, err)
	s.mu.Lock()
	err = s.conn.Fence(context.Background())
	s.mu.Unlock()
	require.NoError(t, err)
	require.True(t, bytes.Equal(p.src.b, p.dst.b), "after the fence's reply every earlier write is in place")
}

func TestVerifyFailsWhenBytesNeverArrive(t *testing.T) {
	recvJS := `{"inject": "drop", "inject_rate": 1}`
	p := newPair(t, `{"max_retries": 3, "retry_sleep_s": 0.001}`, recvJS, 8*1024)
	fill(p.src.b)
	start := time.Now()
	_, err := p.send.Transfer(p.recv.Endpoint(), p.blocks(8, 1024), TransferOptions{})
	require.ErrorIs(t, err, errs.Verify)
	var me *verify.MismatchError
	require.True(t, errors.As(err, &me))
	require.Equal(t, []int{0, 1, 2, 3, 4, 5, 6, 7}, me.Descs)
	require.Less(t, time.Since(start), time.Second)
	require.EqualValues(t, 1, stats(t, p.send)["verify_failures"])
}

func TestResendRepairsLostWrites(t *testing.T) {
	const n, size = 32, 1024
	p := newPair(t, `{"max_retries": 2, "retry_sleep_s": 0, "on_mismatch": "resend", "max_resends": 20}`,
		`{"inject": "drop", "inject_rate": 0.3, "inject_seed": 5}`, n*size)
	fill(p.src.b)
	res, err := p.send.Transfer(p.recv.Endpoint(), p.blocks(n, size), TransferOptions{})
	require.NoError(t, err)
	require.Positive(t, res.Resends)
	require.True(t, bytes.Equal(p.src.b, p.dst.b))

	q := newPair(t, `{"max_retries": 1, "retry_sleep_s": 0, "on_mismatch": "resend", "max_resends": 2}`,
		`{"inject": "drop", "inject_rate": 1}`, n*size)
	fill(q.src.b)
	_, err = q.send.Transfer(q.recv.Endpoint(), q.blocks(4, size), TransferOptions{})
	require.ErrorIs(t, err, errs.Verify)
	require.Contains(t, err.Error(), "after 2 re-sends")
	require.EqualValues(t, 2, stats(t, q.send)["resends"])
}

// Two goroutines write whole-region patterns to the same session at once.
// Serialised batches leave the region all one pattern; interleaved ones
// would leave a mixture.
func TestSameSessionBatchesNeverInterleave(t *testing.T) {
	const n, size = 64, 1024
	send := openGuard(t, "")
	recv := openGuard(t, "")
	dst := newMem(t, n*size)
	require.NoError(t, recv.Register(dst.addr(0), n*size))
	srcs := [2]*mem{newMem(t, n*size), newMem(t, n*size)}
	for i, m := range srcs {
		for j := range m.b {
			m.b[j] = byte('A' + i)
		}
		require.NoError(t, send.Register(m.addr(0), n*size))
	}
	descs := func(m *mem) []desc.Desc {
		d := make([]desc.Desc, n)
		for i := range d {
			d[i] = desc.Desc{Src: m.addr(i * size), Dst: dst.addr(i * size), Len: size}
		}
		return d
	}
	for round := 0; round < 30; round++ {
		var wg sync.WaitGroup
		failed := make([]error, 2)
		for i := range srcs {
			wg.Add(1)
			go func() {
				defer wg.Done()
				_, failed[i] = send.Transfer(recv.Endpoint(), descs(srcs[i]), TransferOptions{Verify: ptr(verify.Off)})
			}()
		}
		wg.Wait()
		require.NoError(t, failed[0])
		require.NoError(t, failed[1])
		first := dst.b[0]
		require.Equal(t, -1, bytes.IndexFunc(dst.b, func(r rune) bool { return byte(r) != first }), "round %d: region is all %q", round, first)
	}
}

func ptr[T any](v T) *T { return &v }

// Sessions verify at the same time with different data; each has its own
// scratch, so all succeed and every destination is right.
func TestConcurrentSessionsUseSeparateScratch(t *testing.T) {
	const sessions, n, size = 4, 32, 8192
	send := openGuard(t, "")
	src := newMem(t, sessions*n*size)
	fill(src.b)
	require.NoError(t, send.Register(src.addr(0), uint64(len(src.b))))
	recvs := make([]*Guard, sessions)
	dsts := make([]*mem, sessions)
	for i := range recvs {
		dsts[i] = newMem(t, n*size)
		recvs[i] = openGuard(t, `{"inject": "lag", "inject_lag_max_ms": 5}`)
		require.NoError(t, recvs[i].Register(dsts[i].addr(0), n*size))
	}
	var wg sync.WaitGroup
	failed := make([]error, sessions)
	for i := range recvs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for round := 0; round < 10 && failed[i] == nil; round++ {
				d := make([]desc.Desc, n)
				for j := range d {
					d[j] = desc.Desc{Src: src.addr((i*n + j) * size), Dst: dsts[i].addr(j * size), Len: size}
				}
				_, failed[i] = send.Transfer(recvs[i].Endpoint(), d, TransferOptions{})
			}
		}()
	}
	wg.Wait()
	for i := range recvs {
		require.NoError(t, failed[i])
		require.True(t, bytes.Equal(src.b[i*n*size:(i+1)*n*size], dsts[i].b), "session %d", i)
	}
	seen := map[*byte]bool{}
	for _, s := range send.sessions {
		b := s.scratch.Bytes(1)
		require.False(t, seen[&b[0]], "two sessions share scratch")
		seen[&b[0]] = true
	}
	require.Len(t, seen, sessions)
}

func TestTransferRejectsBadInput(t *testing.T) {
	p := newPair(t, `{"connect_timeout_ms": 200}`, "", 4096)
	ep := p.recv.Endpoint()
	ok := desc.Desc{Src: p.src.addr(0), Dst: p.dst.addr(0), Len: 64}
	cases := []struct {
		name    string
		session string
		descs   []desc.Desc
		want    error
	}{
		{"no descriptors", ep, nil, errs.InvalidArg},
		{"zero length", ep, []desc.Desc{ok, {Src: ok.Src, Dst: ok.Dst}}, errs.InvalidArg},
		{"source unregistered", ep, []desc.Desc{{Src: p.src.addr(0) + 8192, Dst: ok.Dst, Len: 8}}, errs.NotRegistered},
		{"source overruns region", ep, []desc.Desc{{Src: p.src.addr(4000), Dst: ok.Dst, Len: 200}}, errs.NotRegistered},
		{"source wraps", ep, []desc.Desc{{Src: ^uint64(0) - 4, Dst: ok.Dst, Len: 64}}, errs.NotRegistered},
		{"destination unregistered", ep, []desc.Desc{{Src: ok.Src, Dst: p.dst.addr(0) + 8192, Len: 8}}, errs.NotRegistered},
		{"destination wraps", ep, []desc.Desc{{Src: ok.Src, Dst: ^uint64(0) - 4, Len: 64}}, errs.InvalidArg},
		{"bad session name", "nonsense", []desc.Desc{ok}, errs.InvalidArg},
		{"port out of range", "127.0.0.1:99999", []desc.Desc{ok}, errs.InvalidArg},
		{"no port", "127.0.0.1", []desc.Desc{ok}, errs.InvalidArg},
		{"IPv6 without brackets", "::1:5000", []desc.Desc{ok}, errs.InvalidArg},
		{"refused", unusedAddr(t), []desc.Desc{ok}, errs.Peer},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := p.send.Transfer(tc.session, tc.descs, TransferOptions{})
			require.ErrorIs(t, err, tc.want)
		})
	}
	before := append([]byte(nil), p.dst.b...)
	_, err := p.send.Transfer(ep, []desc.Desc{ok}, TransferOptions{})
	require.NoError(t, err, "the session still works after refusals")
	require.Equal(t, p.src.b[:64], p.dst.b[:64])
	require.Equal(t, before[64:], p.dst.b[64:])
}

func TestDestinationRegisteredAfterHandshake(t *testing.T) {
	more := newMem(t, 4096)
	p := newPair(t, "", "", 4096)
	fill(p.src.b)
	_, err := p.send.Transfer(p.recv.Endpoint(), p.blocks(1, 64), TransferOptions{})
	require.NoError(t, err)
	require.NoError(t, p.recv.Register(more.addr(0), 4096))
	_, err = p.send.Transfer(p.recv.Endpoint(), []desc.Desc{{Src: p.src.addr(0), Dst: more.addr(100), Len: 500}}, TransferOptions{})
	require.NoError(t, err, "a stale region table is refreshed once")
	require.Equal(t, p.src.b[:500], more.b[100:600])
}

func unusedAddr(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	return ln.Addr().String()
}

func TestDeadPeerErrorsThenRecovers(t *testing.T) {
	addr := unusedAddr(t)
	js := fmt.Sprintf(`{"listen": %q}`, addr)
	send := openGuard(t, `{"connect_timeout_ms": 300, "timeout_ms": 500}`)
	src, dst := newMem(t, 4096), newMem(t, 4096)
	fill(src.b)
	require.NoError(t, send.Register(src.addr(0), 4096))
	d := []desc.Desc{{Src: src.addr(0), Dst: dst.addr(0), Len: 4096}}

	recv, err := Open(testConfig(t, js))
	require.NoError(t, err)
	require.NoError(t, recv.Register(dst.addr(0), 4096))
	_, err = send.Transfer(addr, d, TransferOptions{})
	require.NoError(t, err)
	require.NoError(t, recv.Close())

	start := time.Now()
	_, err = send.Transfer(addr, d, TransferOptions{})
	require.Error(t, err)
	require.True(t, errors.Is(err, errs.Peer) || errors.Is(err, errs.Timeout), err.Error())
	require.Less(t, time.Since(start), 2*time.Second)
	start = time.Now()
	_, err = send.Transfer(addr, d, TransferOptions{})
	require.ErrorIs(t, err, errs.Peer, "no guard there: the connection is refused")
	require.ErrorContains(t, err, "connection refused")
	require.Less(t, time.Since(start), 100*time.Millisecond, "refused is said at once, not after connect_timeout")

	recv, err = Open(testConfig(t, js))
	require.NoError(t, err)
	defer recv.Close()
	require.NoError(t, recv.Register(dst.addr(0), 4096))
	clear(dst.b)
	_, err = send.Transfer(addr, d, TransferOptions{})
	require.NoError(t, err, "a restarted receiver on the same address works again")
	require.Equal(t, src.b, dst.b)
}

func TestCloseWhileTransfersInFlight(t *testing.T) {
	p := newPair(t, "", `{"inject": "lag", "inject_lag_max_ms": 5}`, 1<<20)
	var wg sync.WaitGroup
	failed := make(chan error, 100)
	for i := 0; i < 4; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				_, err := p.send.Transfer(p.recv.Endpoint(), p.blocks(16, 64<<10), TransferOptions{})
				if err != nil {
					failed <- err
					return
				}
			}
		}()
	}
	base := runtime.NumGoroutine()
	time.Sleep(50 * time.Millisecond)
	done := make(chan struct{})
	go func() { p.send.Close(); close(done) }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("Close hung with transfers in flight")
	}
	wg.Wait()
	close(failed)
	for err := range failed {
		require.ErrorIs(t, err, errs.Closed)
	}
	require.ErrorIs(t, p.send.Close(), errs.Closed)
	// The sender's goroutines are gone: fewer than while it was busy.
	require.Eventually(t, func() bool { return runtime.NumGoroutine() < base }, 2*time.Second, 20*time.Millisecond)
	require.ErrorIs(t, p.send.Register(p.src.addr(0), 1), errs.Closed)
	_, err := p.send.Stats()
	require.ErrorIs(t, err, errs.Closed)
}

func TestSyncChecksRanges(t *testing.T) {
	g := openGuard(t, "")
	m := newMem(t, 4096)
	require.NoError(t, g.Register(m.addr(0), 4096))
	require.NoError(t, g.Sync([]SyncRange{{m.addr(0), 4096}, {m.addr(10), 1}}, nil, 0))
	require.ErrorIs(t, g.Sync([]SyncRange{{m.addr(4000), 200}}, nil, 0), errs.NotRegistered)
	require.ErrorIs(t, g.Sync([]SyncRange{{m.addr(0), 0}}, nil, 0), errs.NotRegistered)
}

func TestRegions(t *testing.T) {
	var r memory.Regions
	require.NoError(t, r.Add(1000, 100))
	require.NoError(t, r.Add(2000, 100))
	require.NoError(t, r.Add(1100, 900), "adjacent is fine")
	require.ErrorIs(t, r.Add(1050, 10), errs.InvalidArg)
	require.ErrorIs(t, r.Add(500, 501), errs.InvalidArg)
	require.ErrorIs(t, r.Add(0, 10), errs.InvalidArg)
	require.ErrorIs(t, r.Add(^uint64(0)-5, 10), errs.InvalidArg)
	require.NoError(t, r.Check(1000, 100))
	require.Error(t, r.Check(1050, 100), "a range across two regions is not inside one")
	require.Error(t, r.Check(2050, 100))
	require.Error(t, r.Check(999, 1))
	require.NoError(t, r.Remove(1100))
	require.Error(t, r.Check(1100, 1))
	require.ErrorIs(t, r.Remove(1100), errs.NotRegistered)
	require.Len(t, r.Snapshot(), 2)
}

func TestLoadConfig(t *testing.T) {
	env := map[string]string{"MC_GUARD_MAX_BATCH": "64", "MC_GUARD_INJECT": "lag"}
	get := func(k string) (string, bool) { v, ok := env[k]; return v, ok }
	c, err := LoadConfig(get, `{"timeout_ms": 250}`)
	require.NoError(t, err)
	require.Equal(t, 64, c.MaxBatch)
	require.Equal(t, "lag", c.Inject.Mode)
	require.Equal(t, 250*time.Millisecond, c.Timeout)
	for _, js := range []string{`{"listen": "nope"}`, `{"max_batch": 0}`, `{"timeout_ms": 0}`, `{"inject": "gremlins"}`, `{"bogus": 1}`} {
		_, err := LoadConfig(nil, js)
		require.ErrorIs(t, err, errs.Config, js)
	}
}

func jsonUnmarshal(b []byte, v any) error { return json.Unmarshal(b, v) }
