package core

import (
	"bytes"
	"fmt"
	"os"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/core/desc"
	"github.com/mcguard/mcguard/verify"
)

// usage is what a leak would grow.
type usage struct {
	fds, goroutines int
	rssKiB          int
}

func measure(t *testing.T) usage {
	debug.FreeOSMemory() // garbage the runtime has not yet returned is not a leak
	fds, err := os.ReadDir("/proc/self/fd")
	require.NoError(t, err)
	status, err := os.ReadFile("/proc/self/status")
	require.NoError(t, err)
	var rss int
	for _, line := range strings.Split(string(status), "\n") {
		if strings.HasPrefix(line, "VmRSS:") {
			rss, _ = strconv.Atoi(strings.Fields(line)[1])
		}
	}
	return usage{fds: len(fds), goroutines: runtime.NumGoroutine(), rssKiB: rss}
}

// countFromEnv is the count the variable name gives, else def.
func countFromEnv(t testing.TB, name string, def int) int {
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	require.NoError(t, err, name)
	return n
}

// settled waits for goroutines and descriptors that are on their way out.
func settled(t *testing.T, base usage) usage {
	var u usage
	for i := 0; i < 50; i++ {
		u = measure(t)
		if u.goroutines <= base.goroutines+2 && u.fds <= base.fds+2 {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	return u
}

// TestSoak opens, uses and closes guards MCGUARD_SOAK_CYCLES times (10^4
// by default), then runs many sessions at once, and checks that file
// descriptors, goroutines and RSS come back to their baseline. It runs
// without the race detector (make test runs it on its own), which would
// make 10^4 cycles take many minutes.
func TestSoak(t *testing.T) {
	if raceEnabled {
		t.Skip("the soak runs without -race (make test runs it separately); -race covers the same paths in the other tests")
	}
	cycles := countFromEnv(t, "MCGUARD_SOAK_CYCLES", 10000)
	const size = 4096
	src, dst := newMem(t, size), newMem(t, 64*size)
	fill(src.b)
	recv, err := Open(testConfig(t, ""))
	require.NoError(t, err)
	require.NoError(t, recv.Register(dst.addr(0), 64*size))
	// Warm up once so lazily started runtime pieces are in the baseline.
	soakCycle(t, recv, src, dst, 0)
	base := measure(t)
	start := time.Now()
	for i := 0; i < cycles; i++ {
		soakCycle(t, recv, src, dst, i%64)
		if i%2000 == 1999 {
			u := measure(t)
			t.Logf("cycle %d: %v, fds %d, goroutines %d, rss %d MiB", i+1, time.Since(start).Round(time.Millisecond), u.fds, u.goroutines, u.rssKiB>>10)
		}
	}
	t.Logf("%d open/transfer/close cycles in %v", cycles, time.Since(start).Round(time.Millisecond))

	// Many sessions at once: 32 receivers, one sender, 32 goroutines.
	const sessions = 32
	send, err := Open(testConfig(t, ""))
	require.NoError(t, err)
	big := newMem(t, sessions*64*size)
	fill(big.b)
	require.NoError(t, send.Register(big.addr(0), uint64(len(big.b))))
	recvs := make([]*Guard, sessions)
	dsts := make([]*mem, sessions)
	for i := range recvs {
		dsts[i] = newMem(t, 64*size)
		recvs[i], err = Open(testConfig(t, ""))
		require.NoError(t, err)
		require.NoError(t, recvs[i].Register(dsts[i].addr(0), 64*size))
	}
	var wg sync.WaitGroup
	failed := make([]error, sessions)
	for i := range recvs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			d := make([]desc.Desc, 64)
			for j := range d {
				d[j] = desc.Desc{Src: big.addr((i*64 + j) * size), Dst: dsts[i].addr(j * size), Len: size}
			}
			for r := 0; r < 20 && failed[i] == nil; r++ {
				_, failed[i] = send.Transfer(recvs[i].Endpoint(), d, TransferOptions{Verify: ptr(verify.Sample)})
			}
		}()
	}
	wg.Wait()
	for i := range recvs {
		require.NoError(t, failed[i])
		require.True(t, bytes.Equal(big.b[i*64*size:(i+1)*64*size], dsts[i].b), "session %d", i)
		require.NoError(t, recvs[i].Close())
	}
	require.NoError(t, send.Close())

	after := settled(t, base)
	t.Logf("baseline fds %d goroutines %d rss %d MiB; after fds %d goroutines %d rss %d MiB",
		base.fds, base.goroutines, base.rssKiB>>10, after.fds, after.goroutines, after.rssKiB>>10)
	require.LessOrEqual(t, after.fds, base.fds+2, "file descriptors leaked")
	require.LessOrEqual(t, after.goroutines, base.goroutines+2, "goroutines leaked")
	require.LessOrEqual(t, after.rssKiB, base.rssKiB+96<<10, "RSS grew by more than 96 MiB")
	require.NoError(t, recv.Close())
}

func soakCycle(t *testing.T, recv *Guard, src, dst *mem, block int) {
	g, err := Open(testConfig(t, ""))
	if err != nil {
		t.Fatal(err)
	}
	if err := g.Register(src.addr(0), 4096); err != nil {
		t.Fatal(err)
	}
	_, err = g.Transfer(recv.Endpoint(), []desc.Desc{{Src: src.addr(0), Dst: dst.addr(block * 4096), Len: 4096}}, TransferOptions{})
	if err != nil {
		t.Fatal(fmt.Errorf("cycle transfer: %w", err))
	}
	if !bytes.Equal(src.b, dst.b[block*4096:(block+1)*4096]) {
		t.Fatal("cycle transfer: destination differs")
	}
	if err := g.Close(); err != nil {
		t.Fatal(err)
	}
}
