package core

import (
	"runtime"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/core/desc"
	"github.com/mcguard/mcguard/core/errs"
)

// Background digests run on workers that are reused, of which only a few
// stay idle, and that end when the guard closes. Each result is the
// sources' digests, as taken inline.
func TestDigestWorkersAreReusedAndEndWithTheGuard(t *testing.T) {
	const n, size = 16, 64 << 10
	g, err := Open(testConfig(t, ""))
	require.NoError(t, err)
	m := newMem(t, n*size)
	fill(m.b)
	require.NoError(t, g.Register(m.addr(0), n*size))
	chunk := make([]desc.Desc, n)
	for i := range chunk {
		chunk[i] = desc.Desc{Src: m.addr(i * size), Len: size}
	}
	want := make([]uint64, n)
	require.NoError(t, g.digestSources(chunk, want))

	// A burst: more jobs at once than may stay idle.
	burst := int(maxIdleDigesters()) * 3
	jobs, results := make([]digestJob, burst), make([][]uint64, burst)
	done := make([]<-chan error, burst)
	for i := range jobs {
		results[i] = make([]uint64, n)
		done[i] = g.digestInBackground(&jobs[i], chunk, results[i])
	}
	for i := range jobs {
		require.NoError(t, <-done[i])
		require.Equal(t, want, results[i])
	}
	require.Eventually(t, func() bool { return g.digesters.idle.Load() <= maxIdleDigesters() }, 2*time.Second, time.Millisecond,
		"a burst leaves at most maxIdleDigesters idle")

	// One job after another: an idle worker takes each, none is added.
	var job digestJob
	got := make([]uint64, n)
	require.NoError(t, <-g.digestInBackground(&job, chunk, got)) // a worker is idle again after this
	time.Sleep(10 * time.Millisecond)
	before := runtime.NumGoroutine()
	for range 100 {
		clear(got)
		require.NoError(t, <-g.digestInBackground(&job, chunk, got))
		require.Equal(t, want, got)
		require.Nil(t, job.chunk, "the worker keeps nothing of the caller's")
	}
	require.LessOrEqual(t, runtime.NumGoroutine(), before+1, "workers are reused, not started per job")

	// A source that is not registered fails the job, not the worker.
	bad := []desc.Desc{{Src: m.addr(0) + n*size, Len: size}}
	require.ErrorIs(t, <-g.digestInBackground(&job, bad, got[:1]), errs.NotRegistered)
	require.NoError(t, <-g.digestInBackground(&job, chunk, got))

	require.NoError(t, g.Close())
	require.Eventually(t, func() bool { return g.digesters.idle.Load() == 0 }, 2*time.Second, time.Millisecond,
		"idle workers end with the guard")
}
