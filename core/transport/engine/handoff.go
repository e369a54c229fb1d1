package engine

import (
	"sync"
	"sync/atomic"
	"time"

	"github.com/mcguard/mcguard/core/transport"
)

// Handing an engine call to another thread, so that a call past its
// deadline can be given up. On a virtual machine a thread asleep in the
// kernel takes tens of µs to wake, and a plain hand-off (a new goroutine,
// the caller asleep until it answers) wakes two: through a C engine that
// copies 4 KiB, 125 µs a transfer against 5 with the call inline. So a
// worker that finished a call stays awake for a while (spin) for the next
// one, and the caller stays awake as long for the answer before it
// sleeps; both yield their core at every turn to any thread that wants it
// (the engine's own, on a small machine), and each backs off where its
// spins do not pay (transport.SpinBackoff: calls longer than the spin,
// or far apart).

// handoff runs engine calls on its workers.
type handoff struct {
	spin   time.Duration // 0: no one waits awake
	mu     sync.Mutex
	idle   []*worker // waiting for a call, awake or asleep
	closed bool
	live   atomic.Int32 // workers, busy or idle
}

// worker is one goroutine that runs calls, one at a time.
type worker struct {
	calls chan call // buffered: whoever took the worker from idle sends one; one without fn ends it
	spins transport.SpinBackoff
}

// call is one engine call for a worker, and where its answer goes.
type call struct {
	fn  func() error
	res chan<- error
}

// maxIdleWorkers bounds the workers kept for the next calls; calls at once
// beyond it (a hung engine's, several sessions') get workers that end
// after their call.
const maxIdleWorkers = 4

// run starts fn on a worker; its answer comes on the channel returned.
func (h *handoff) run(fn func() error) <-chan error {
	h.mu.Lock()
	var w *worker
	if k := len(h.idle); k > 0 {
		w = h.idle[k-1]
		h.idle = h.idle[:k-1]
	}
	h.mu.Unlock()
	if w == nil {
		w = &worker{calls: make(chan call, 1)}
		h.live.Add(1)
		go h.work(w)
	}
	res := make(chan error, 1)
	w.calls <- call{fn, res}
	return res
}

// work runs w's calls until it is not kept idle or is told to end. A
// worker is idle again before its call's answer goes, so the caller's
// next call finds it rather than starting another.
func (h *handoff) work(w *worker) {
	defer h.live.Add(-1)
	for c := <-w.calls; c.fn != nil; c = h.next(w) {
		err := c.fn()
		kept := h.keep(w)
		c.res <- err
		if !kept {
			return
		}
	}
}

// keep puts w among the idle workers; false where there is no room, or
// the plane closed.
func (h *handoff) keep(w *worker) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed || len(h.idle) >= maxIdleWorkers {
		return false
	}
	h.idle = append(h.idle, w)
	return true
}

// next is w's next call: awake for up to spin, then asleep.
func (h *handoff) next(w *worker) call {
	if c, ok := spinFor(h.spin, &w.spins, w.calls); ok {
		return c
	}
	return <-w.calls
}

// await is a call's answer on res if it comes within spin, waiting awake;
// spins is the caller's back-off.
func (h *handoff) await(res <-chan error, spins *transport.SpinBackoff) (error, bool) {
	return spinFor(h.spin, spins, res)
}

// spinFor receives from ch for up to spin, yielding at every turn, unless
// the back-off skips this wait; whether it did.
func spinFor[T any](spin time.Duration, spins *transport.SpinBackoff, ch <-chan T) (T, bool) {
	var none T
	if spin <= 0 || spins.Skipping() {
		return none, false
	}
	for start := time.Now(); ; transport.Yield() {
		spent := time.Since(start)
		select {
		case v := <-ch:
			spins.Paid(transport.SpinPays(spent, spin))
			return v, true
		default:
		}
		if spent >= spin {
			spins.Paid(false)
			return none, false
		}
	}
}

// close ends the idle workers; workers busy with a call end after it.
func (h *handoff) close() {
	h.mu.Lock()
	idle := h.idle
	h.idle, h.closed = nil, true
	h.mu.Unlock()
	for _, w := range idle {
		w.calls <- call{}
	}
}
