// Package engine is the data plane an application brings: a transfer
// engine it already runs (Mooncake's, NIXL, its own verbs), reached
// through write and read batch callbacks. The engine moves the bytes; the
// guard around it serialises sessions, verifies by reading back through
// the same engine, and keeps the scratch those reads land in registered
// with it. Nothing here can see the engine's wire, so there is no fence
// unless the application gives one, and read-backs poll.
package engine

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/mcguard/mcguard/core/cuda"
	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/core/fault"
	"github.com/mcguard/mcguard/core/logs"
	"github.com/mcguard/mcguard/core/memory"
	"github.com/mcguard/mcguard/core/transport"
)

// Name is what stats call this data plane.
const Name = "engine"

// Batch is one call into the engine: n[i] bytes between local[i] and
// remote[i] at session (the engine's own name for the peer).
type Batch func(session string, local, remote, n []uint64) error

// Ops is the engine, as the application hands it over. Write and Read are
// required; the rest may be nil. Calls for different sessions may run at
// once, from any goroutine; calls for one session come one at a time,
// except writes that fault injection holds back and hands over later.
type Ops struct {
	// Name says which engine this is ("mooncake", ...), for stats and for
	// defaults that follow the engine (Mooncake's slice size).
	Name string
	// Write and Read move a batch and return once the engine reports it
	// complete (which this library then checks).
	Write, Read Batch
	// Register and Unregister make memory the engine's, so that it can
	// be a source or receive read-backs (the guard's scratch).
	Register   func(addr, n uint64) error
	Unregister func(addr uint64) error
	// Fence, if the engine has one, returns once every write it
	// completed to session is in place there.
	Fence func(session string) error
}

// Config opens the data plane.
type Config struct {
	Ops    Ops
	Faults fault.Config // injected at the callback layer: lag, drop, tear, reorder, hold
	// Linger bounds how long Close waits for engine calls still running
	// (ones a cancelled transfer left behind).
	Linger time.Duration
	// Timeout bounds each engine call of a transfer that has no deadline
	// of its own (timeout_ms).
	Timeout time.Duration
	// Inline runs each call on the caller's thread (see call).
	Inline bool
	// Spin is how long a worker that ran a call waits awake for the next,
	// and a caller for a call's answer, before sleeping (handoff).
	Spin time.Duration
	// JoinMax > 0 joins descriptors that continue one another at both
	// ends into one request of at most JoinMax bytes, over a session
	// checked through the peer's guard, whose region table says where
	// the peer's host memory runs (LocalReach says it here): a request
	// never leaves a region at either end. It is the engine's slice
	// size, so that a joined request is one slice of the engine's,
	// ending where a descriptor ends: the tail a check reads is that
	// slice's. 0: one request per descriptor.
	JoinMax uint64
	// LocalReach is how far from addr this process's registered host
	// memory runs (0: none, or device memory).
	LocalReach func(addr uint64) uint64
	// Joined counts the descriptors sent inside another's request.
	Joined *atomic.Int64
	// CallTime, if set, is told each engine call's time as it returns
	// (the guard's stats and metrics).
	CallTime func(time.Duration)
}

// Plane is the engine data plane: the sender's side only. The engine
// delivers to the peer by itself, so this guard has nothing to accept or
// settle for it, and a receiver's quiesce is kept at the sender
// (QuiesceSession).
type Plane struct {
	ops     Ops
	faults  *fault.Injector
	lies    lies // under fault.Lie: the writes it kept to itself
	linger  time.Duration
	timeout time.Duration
	inline  bool
	handoff handoff // runs the calls that are not inline
	join    joins

	mu     sync.Mutex
	closed bool
	calls  sync.WaitGroup // engine calls running, held writes included
	// running counts calls as well, for InFlight: a WaitGroup cannot be read
	running  atomic.Int64
	callTime func(time.Duration) // Config.CallTime
	// byTransfer holds, for each transfer with engine calls running, how
	// many and, once WaitTransfer asks, a channel closed when the last
	// returns. An entry lives only while its calls run: the map is no
	// larger than the calls running.
	byTransfer map[uint64]transferCalls
	// epoch counts the receivers' quiesces kept here (QuiesceSession);
	// sessions holds each session's fences and what runs under them;
	// spare is the state of a session that held nothing any more, kept
	// for the next (its maps keep their room).
	epoch    uint64
	sessions map[string]*sessionFences
	spare    *sessionFences
}

// Open checks ops and returns the data plane.
func Open(cfg Config) (*Plane, error) {
	if cfg.Ops.Write == nil || cfg.Ops.Read == nil {
		return nil, fmt.Errorf("%w: an engine data plane needs both a write and a read callback", errs.InvalidArg)
	}
	if cfg.Faults.Mode == fault.Stale {
		return nil, fmt.Errorf("%w: inject stale needs the destination's bytes, which an engine's callbacks do not show; over an engine use lag, drop, tear, reorder or hold", errs.Config)
	}
	if cfg.Timeout <= 0 {
		return nil, fmt.Errorf("%w: an engine data plane needs a timeout for its calls", errs.Config)
	}
	p := &Plane{ops: cfg.Ops, linger: cfg.Linger, timeout: cfg.Timeout, inline: cfg.Inline, handoff: handoff{spin: cfg.Spin},
		join:       joins{max: cfg.JoinMax, local: cfg.LocalReach, count: cfg.Joined},
		byTransfer: map[uint64]transferCalls{}, sessions: map[string]*sessionFences{}, callTime: cfg.CallTime}
	p.faults = fault.New(cfg.Faults, 0, "the engine callbacks ("+cfg.Ops.Name+")")
	return p, nil
}

// Name implements transport.Transport.
func (p *Plane) Name() string { return Name }

// Engine is the engine's own name ("mooncake", ...).
func (p *Plane) Engine() string { return p.ops.Name }

// Describe implements transport.Transport.
func (p *Plane) Describe() string {
	fence := "no fence: read-backs poll"
	if p.ops.Fence != nil {
		fence = "with the engine's fence"
	}
	name := p.ops.Name
	if name == "" {
		name = "unnamed"
	}
	return fmt.Sprintf("%s engine through callbacks (%s)", name, fence)
}

// Register hands a region the guard registered to the engine too.
func (p *Plane) Register(addr, n uint64, _ cuda.Memory) error {
	if p.ops.Register == nil {
		return nil
	}
	if err := p.ops.Register(addr, n); err != nil {
		return fmt.Errorf("the engine refused to register [%#x, +%d): %w", addr, n, err)
	}
	return nil
}

// Unregister hands the region back; the guard's own table has let go of it
// already, so a refusal is only logged.
func (p *Plane) Unregister(addr uint64) error {
	if p.ops.Unregister == nil {
		return nil
	}
	if err := p.ops.Unregister(addr); err != nil {
		logs.Printf(logs.Warn, "the engine refused to unregister %#x: %v", addr, err)
	}
	return nil
}

// Dial is not how this data plane connects: a session over an engine needs
// no handshake (core calls Conn).
func (p *Plane) Dial() (transport.Dialer, error) {
	return nil, fmt.Errorf("%w: the engine data plane connects through the engine, not a handshake", errs.InvalidArg)
}

// Accept: peers write into this guard over their engine, not through it.
func (p *Plane) Accept(transport.Peer, []byte, []memory.Region) ([]byte, error) {
	return nil, fmt.Errorf("the engine data plane accepts nothing: peers reach this guard's memory through their engine")
}

// Settle has nothing to wait for: the engine's writes pass no code of ours
// at the target, and the sender reports them complete only after its
// engine did.
func (p *Plane) Settle(context.Context, []memory.Region) error { return nil }

// Quiesce cannot be promised here: the engine writes into this guard's
// memory without this library. The senders' guards can keep it
// (QuiesceSession), once the application tells them.
func (p *Plane) Quiesce(context.Context, []memory.Region) error {
	return fmt.Errorf("quiesce is not available at the receiver over an engine data plane (%s): its writes do not pass through mcguard, so nothing here can refuse a late one; tell each sender's guard (mc_guard_quiesce_engine) before reusing the ranges", p.Describe())
}

// Abort: the peer's engine writes without us; nothing to cut off here.
func (p *Plane) Abort(transport.Peer) error { return nil }

// Connections implements transport.Transport.
func (p *Plane) Connections() int { return 0 }

// Stats adds the engine calls running to a guard's stats.
func (p *Plane) Stats(out map[string]any) { out["engine_calls_in_flight"] = p.InFlight() }

// timed runs one engine call, telling Config.CallTime the time it took.
func (p *Plane) timed(fn func() error) (time.Duration, error) {
	start := time.Now()
	err := fn()
	took := time.Since(start)
	if p.callTime != nil {
		p.callTime(took)
	}
	return took, err
}

// Close waits, up to the linger time, for engine calls still running, and
// refuses new ones: the application may tear its engine down afterwards.
func (p *Plane) Close() {
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	p.handoff.close()
	done := make(chan struct{})
	go func() { p.calls.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(p.linger):
		logs.Printf(logs.Warn, "engine data plane closed with engine calls still running after %v (a cancelled transfer's); they may still write", p.linger)
	}
}

// begin admits one engine call for transfer (0: none) to session, of a
// transfer that began under epoch began, unless the plane is closed or,
// for a write (remote, n: its destinations), a receiver's quiesce kept
// since the transfer began covers one of them.
func (p *Plane) begin(transfer uint64, session string, began uint64, remote, n []uint64) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return fmt.Errorf("%w: the engine data plane is closed", errs.Closed)
	}
	if err := p.fencedLocked(session, began, remote, n); err != nil {
		return err
	}
	p.calls.Add(1)
	p.running.Add(1)
	p.beginCallLocked(session, began)
	if transfer != 0 {
		addCall(p.byTransfer, transfer)
	}
	return nil
}

// end is begin's other half, once the engine call has returned.
func (p *Plane) end(transfer uint64, session string, began uint64) {
	p.running.Add(-1) // first: a waiter woken below sees it
	p.mu.Lock()
	if transfer != 0 {
		endCall(p.byTransfer, transfer)
	}
	p.endCallLocked(session, began)
	p.mu.Unlock()
	p.calls.Done()
}

// InFlight is how many engine calls are running now, held writes
// included, for every transfer: WaitTransfer waits for one transfer's.
func (p *Plane) InFlight() int64 { return p.running.Load() }

// Transfers is how many transfers have engine calls running: the size of
// the per-transfer table, which must not outgrow the calls themselves.
func (p *Plane) Transfers() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.byTransfer)
}

// WaitTransfer returns once no engine call made for transfer is running
// any more, held writes included: from then on the engine can deliver
// nothing of it that this library handed over (it may still run slices of
// a call that returned: nothing here can see those). Past ctx's end it
// fails, saying how many are still running.
func (p *Plane) WaitTransfer(ctx context.Context, transfer uint64) error {
	p.mu.Lock()
	done := waitCalls(p.byTransfer, transfer)
	p.mu.Unlock()
	if done == nil {
		return nil
	}
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		p.mu.Lock()
		n := p.byTransfer[transfer].n
		p.mu.Unlock()
		if n == 0 {
			return nil
		}
		return fmt.Errorf("%w: %d engine call(s) of transfer %#x still running (%v): their bytes may still land", errs.Timeout, n, transfer, context.Cause(ctx))
	}
}

// call runs one engine call (a write to remote, n; nil for others) and
// returns its error. By default the call
// runs apart, and call returns at ctx's deadline, or timeout_ms after it
// began where ctx has none, or once ctx is cancelled: a callback that
// never returns cannot hold the transfer past its deadline. The call
// itself cannot be interrupted and finishes on its own, after which done
// runs (to release what it wrote into); its result is dropped, and it
// counts as in flight (WaitTransfer) until then. Inline (Config.Inline),
// it runs on the caller's thread, which saves the hand-off to another
// thread and back (tens of µs on a VM, more where a Python callback needs
// a thread state), and a call that returns past its deadline fails then.
func (p *Plane) call(ctx context.Context, c *conn, remote, n []uint64, fn func() error, done func()) error {
	transfer, session, began := c.transfer, c.session, c.began
	if err := p.begin(transfer, session, began, remote, n); err != nil {
		return err
	}
	_, bounded := ctx.Deadline()
	if p.inline { // timed against the clock after the call, without a context's timer
		defer p.end(transfer, session, began)
		took, err := p.timed(fn)
		if done != nil {
			done()
		}
		var late error // why the call returned too late to count
		switch {
		case err != nil:
			return err
		case ctx.Err() != nil:
			late = context.Cause(ctx)
		case !bounded && took > p.timeout:
			late = errCallTimeout
		default:
			return nil
		}
		return fmt.Errorf("%w: the transfer ended (%v) while the engine moved its bytes", errs.Timeout, late)
	}
	if !bounded {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeoutCause(ctx, p.timeout, errCallTimeout)
		defer cancel()
	}
	res := p.handoff.run(func() error {
		defer p.end(transfer, session, began)
		_, err := p.timed(fn)
		if done != nil {
			done()
		}
		return err
	})
	if err, ok := p.handoff.await(res, &c.spins); ok {
		return err
	}
	select {
	case err := <-res:
		return err
	case <-ctx.Done():
		return fmt.Errorf("%w: gave up waiting for the engine (its call goes on and may still land): %v", errs.Timeout, context.Cause(ctx))
	}
}

// errCallTimeout is why an engine call was given up on where its transfer
// had no deadline of its own.
var errCallTimeout = errors.New("the engine call took longer than timeout_ms")

// hold hands a write to the engine after a delay, as fault injection asks:
// the transfer was told it completed long before. A receiver's quiesce
// kept meanwhile (QuiesceSession) keeps it from the engine.
func (p *Plane) hold(c *conn, local, remote, n uint64) {
	transfer, session, began := c.transfer, c.session, c.began
	dst, length := []uint64{remote}, []uint64{n}
	if p.begin(transfer, session, began, dst, length) != nil {
		return
	}
	time.AfterFunc(p.faults.Delay(), func() {
		defer p.end(transfer, session, began)
		p.mu.Lock()
		ok := !p.closed && p.fencedLocked(session, began, dst, length) == nil
		p.mu.Unlock()
		if ok { // a quiesce from now on waits for this call (counted since begin)
			_ = p.ops.Write(session, []uint64{local}, dst, length)
		}
	})
}
