package engine

import (
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/core/transport"
)

// workersSettle waits until h has at most n workers, and returns how
// many it has.
func workersSettle(t *testing.T, h *handoff, n int32) int32 {
	t.Helper()
	for end := time.Now().Add(5 * time.Second); time.Now().Before(end) && h.live.Load() > n; time.Sleep(time.Millisecond) {
	}
	return h.live.Load()
}

func TestHandoffRunsCallsOnWorkersItKeeps(t *testing.T) {
	for _, spin := range []time.Duration{0, 200 * time.Microsecond} {
		h := &handoff{spin: spin}
		var spins transport.SpinBackoff
		for i := 0; i < 200; i++ {
			want := errors.New("call")
			res := h.run(func() error { return want })
			err, ok := h.await(res, &spins)
			if !ok {
				err = <-res
			}
			require.Same(t, want, err)
			require.EqualValues(t, 1, h.live.Load(), "one call at a time: one worker, kept (spin %v)", spin)
		}
		h.close()
		require.Zero(t, workersSettle(t, h, 0), "close ends the idle worker")
	}
}

func TestHandoffKeepsAtMostMaxIdleWorkersAndEndsTheRestAfterTheirCalls(t *testing.T) {
	h := &handoff{spin: 100 * time.Microsecond}
	release := make(chan struct{})
	var running, ran sync.WaitGroup
	const calls = 3 * maxIdleWorkers
	for i := 0; i < calls; i++ {
		running.Add(1)
		ran.Add(1)
		h.run(func() error { running.Done(); <-release; ran.Done(); return nil })
	}
	running.Wait() // every call at once: a worker each
	require.EqualValues(t, calls, h.live.Load())
	close(release)
	ran.Wait()
	require.EqualValues(t, maxIdleWorkers, workersSettle(t, h, maxIdleWorkers))
	time.Sleep(10 * time.Millisecond)
	require.EqualValues(t, maxIdleWorkers, h.live.Load(), "the kept ones stay")
	h.close()
	require.Zero(t, workersSettle(t, h, 0))
	done := make(chan struct{})
	h.run(func() error { close(done); return nil }) // after close: a worker for the call, which ends after it
	<-done
	require.Zero(t, workersSettle(t, h, 0))
}

func TestHandoffAwaitGivesUpAfterItsSpinAndTheAnswerStillComes(t *testing.T) {
	h := &handoff{spin: 50 * time.Microsecond}
	defer h.close()
	release := make(chan struct{})
	res := h.run(func() error { <-release; return nil })
	var spins transport.SpinBackoff
	start := time.Now()
	_, ok := h.await(res, &spins)
	require.False(t, ok, "a call that is not done by the spin's end")
	require.Less(t, time.Since(start), time.Second)
	close(release)
	require.NoError(t, <-res)
}
