package core

import (
	"bytes"
	"fmt"
	"net"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	zmq "github.com/pebbe/zmq4"
	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/core/auth"
	"github.com/mcguard/mcguard/core/control"
	"github.com/mcguard/mcguard/core/desc"
	"github.com/mcguard/mcguard/core/wire"
)

// TestEndurance runs one receiver for MCGUARD_ENDURANCE_HANDSHAKES
// handshakes from churning senders (3000 in make test, 10^5 in make
// endurance), while a long-lived digest session and a long-lived tail
// session keep transferring, every byte checked at the receiver after each
// round, and episodes come by in turn: descriptor exhaustion (the
// process's RLIMIT_NOFILE lowered to what it has open), a control-port
// flood from a child process, and peers that stall in a write's payload.
// At the end both sessions still work and RSS, descriptors and goroutines
// are back near their baseline. It prints progress and a summary table.
func TestEndurance(t *testing.T) {
	if raceEnabled {
		t.Skip("run without the race detector (make test runs it on its own)")
	}
	total := countFromEnv(t, "MCGUARD_ENDURANCE_HANDSHAKES", 3000)
	const blocks, size = 32, 16 << 10
	recv, err := Open(testConfig(t, `{"timeout_ms": 1000}`))
	require.NoError(t, err)
	dstDigest, dstTail, stalledOn := newMem(t, blocks*size), newMem(t, blocks*size), newMem(t, size)
	require.NoError(t, recv.Register(dstDigest.addr(0), blocks*size))
	require.NoError(t, recv.Register(dstTail.addr(0), blocks*size))
	require.NoError(t, recv.Register(stalledOn.addr(0), size))

	type longLived struct {
		name      string
		g         *Guard
		src, dst  *mem
		rounds    atomic.Int64
		failures  atomic.Int64
		lastError atomic.Value
	}
	sessions := []*longLived{{name: "digest", dst: dstDigest}, {name: "tail", dst: dstTail}}
	for _, s := range sessions {
		s.g, err = Open(testConfig(t, fmt.Sprintf(`{"verify": %q}`, s.name)))
		require.NoError(t, err)
		s.src = newMem(t, blocks*size)
		require.NoError(t, s.g.Register(s.src.addr(0), blocks*size))
	}
	round := func(s *longLived) error {
		fill(s.src.b)
		d := make([]desc.Desc, blocks)
		for i := range d {
			d[i] = desc.Desc{Src: s.src.addr(i * size), Dst: s.dst.addr(i * size), Len: size}
		}
		res, err := s.g.Transfer(recv.Endpoint(), d, TransferOptions{})
		if err == nil && s.name == "digest" {
			err = recv.SyncTransfers([]uint64{res.ID}, 0)
		}
		if err == nil && !bytes.Equal(s.src.b, s.dst.b) {
			err = fmt.Errorf("a successful %s round left the destination different from the source", s.name)
		}
		return err
	}
	for _, s := range sessions {
		require.NoError(t, round(s), "warm-up")
	}
	zctx, err := zmq.NewContext()
	require.NoError(t, err)
	defer zctx.Term()
	base := measure(t)

	stop := make(chan struct{})
	var wg sync.WaitGroup
	var wrong atomic.Int64 // successes whose bytes differed: must stay 0
	for _, s := range sessions {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				if err := round(s); err != nil {
					if strings.Contains(err.Error(), "left the destination different") {
						wrong.Add(1)
					}
					s.failures.Add(1)
					s.lastError.Store(err.Error())
					time.Sleep(10 * time.Millisecond)
					continue
				}
				s.rounds.Add(1)
			}
		}()
	}

	var handshakes, handshakeFailures atomic.Int64
	churn := func(n int) {
		for i := 0; i < n; i++ {
			_, err := control.Handshake(t.Context(), zctx, recv.Endpoint(), time.Second, nil, control.Hello{Sender: auth.RandomBytes(auth.NonceSize), Transport: "tcp"})
			handshakes.Add(1)
			if err != nil {
				handshakeFailures.Add(1)
			}
		}
	}
	episodes := []struct {
		name string
		run  func()
	}{
		{"descriptor exhaustion", func() {
			var lim syscall.Rlimit
			require.NoError(t, syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim))
			fds, _ := os.ReadDir("/proc/self/fd")
			tight := lim
			tight.Cur = uint64(len(fds)) + 4
			require.NoError(t, syscall.Setrlimit(syscall.RLIMIT_NOFILE, &tight))
			churn(200) // new connections now fail at both ends, for a while
			require.NoError(t, syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim))
		}},
		{"control flood", func() {
			cmd := flood(t, recv.Endpoint(), 300, 20, 500*time.Millisecond)
			churn(100)
			cmd.wait(t)
		}},
		{"stalled peers", func() {
			hello := shakeHands(t, recv, auth.RandomBytes(auth.NonceSize))
			var conns []net.Conn
			for i := 0; i < 8; i++ {
				c := dataConn(t, recv, hello)
				c.Write(frame(wire.Header{Op: wire.OpWrite, ID: 2, Addr: stalledOn.addr(0), Len: size}, make([]byte, 100)))
				conns = append(conns, c)
			}
			churn(100)
			for _, c := range conns {
				c.Close()
			}
		}},
	}
	type row struct {
		what                  string
		handshakes, failed    int64
		digestOK, tailOK      int64
		fds, goroutines, rssM int
		took                  time.Duration
	}
	var rows []row
	record := func(what string, start time.Time) {
		u := measure(t)
		r := row{what, handshakes.Load(), handshakeFailures.Load(), sessions[0].rounds.Load(), sessions[1].rounds.Load(), u.fds, u.goroutines, u.rssKiB >> 10, time.Since(start).Round(time.Millisecond)}
		rows = append(rows, r)
		t.Logf("progress: %-22s handshakes %7d (failed %d)  digest rounds %6d  tail rounds %6d  fds %3d  goroutines %3d  rss %3d MiB  %v",
			r.what, r.handshakes, r.failed, r.digestOK, r.tailOK, r.fds, r.goroutines, r.rssM, r.took)
	}
	start := time.Now()
	step := max(total/10, 100)
	for k := 0; handshakes.Load() < int64(total); k++ {
		churn(min(step, total-int(handshakes.Load())))
		record("churn", start)
		e := episodes[k%len(episodes)]
		e.run()
		record(e.name, start)
	}
	close(stop)
	wg.Wait()

	for _, s := range sessions {
		require.NoError(t, round(s), "the long-lived %s session still works", s.name)
	}
	after := settled(t, base)
	t.Logf("summary:\n%-22s %10s %8s %10s %10s %5s %10s %8s\n", "after", "handshakes", "failed", "digest ok", "tail ok", "fds", "goroutines", "rss MiB")
	for _, r := range rows {
		t.Logf("%-22s %10d %8d %10d %10d %5d %10d %8d", r.what, r.handshakes, r.failed, r.digestOK, r.tailOK, r.fds, r.goroutines, r.rssM)
	}
	t.Logf("baseline fds %d goroutines %d rss %d MiB; at the end fds %d goroutines %d rss %d MiB; %v",
		base.fds, base.goroutines, base.rssKiB>>10, after.fds, after.goroutines, after.rssKiB>>10, time.Since(start).Round(time.Millisecond))
	for _, s := range sessions {
		if v := s.lastError.Load(); v != nil {
			t.Logf("%s: %d failed rounds (during episodes), the last: %v", s.name, s.failures.Load(), v)
		}
	}
	require.Zero(t, wrong.Load(), "no success held wrong bytes")
	require.Positive(t, sessions[0].rounds.Load())
	require.Positive(t, sessions[1].rounds.Load())
	require.LessOrEqual(t, after.fds, base.fds+4, "file descriptors leaked")
	require.LessOrEqual(t, after.goroutines, base.goroutines+4, "goroutines leaked")
	require.LessOrEqual(t, after.rssKiB, base.rssKiB+64<<10, "RSS grew by more than 64 MiB")
	senders, tokens := recv.auth.Tokens.Size()
	require.LessOrEqual(t, senders, auth.MaxSenders)
	require.LessOrEqual(t, tokens, senders*auth.TokensPerSender)
	for _, s := range sessions {
		require.NoError(t, s.g.Close())
	}
	require.NoError(t, recv.Close())
}
