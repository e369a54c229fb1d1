package core

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/mcguard/mcguard/core/control"
	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/core/memory"
	"github.com/mcguard/mcguard/core/transport"
	"github.com/mcguard/mcguard/core/transport/engine"
	"github.com/mcguard/mcguard/verify"
)

// A guard over the application's own engine: the engine moves the bytes,
// the guard verifies through it (core/transport/engine).

// OpenWithEngine opens a guard whose data plane is ops, the application's
// engine. It still listens for handshakes and notices (a peer guard's
// digests) and serves TCP to peers that send over mcguard's own.
func OpenWithEngine(cfg Config, ops engine.Ops) (*Guard, error) {
	if cfg.RequireRDMA {
		return nil, fmt.Errorf("%w: require_rdma asks for mcguard's RDMA data plane, and this guard sends through the application's engine: drop require_rdma", errs.Config)
	}
	if cfg.Transport != "auto" && cfg.Transport != engine.Name {
		return nil, fmt.Errorf("%w: transport %q names mcguard's own data plane, and this guard sends through the application's engine: leave transport unset", errs.Config, cfg.Transport)
	}
	cfg.Transport = engine.Name
	getenv := os.Getenv
	if cfg.Getenv != nil {
		getenv = func(name string) string { v, _ := cfg.Getenv(name); return v }
	}
	sliceBytes := engineSliceBytes(ops.Name, getenv)
	if cfg.Verify.SliceBytes == verify.SliceAuto {
		cfg.Verify.SliceBytes = sliceBytes
	}
	return open(cfg, func(g *Guard) (enginePlane, error) {
		cfg := &g.cfg
		return engine.Open(engine.Config{Ops: ops, Faults: cfg.Inject, Linger: cfg.Timeout, Timeout: cfg.Timeout,
			Inline: cfg.Planes.Engine.InlineCalls, Spin: cfg.Planes.Engine.BusyPoll,
			JoinMax: uint64(sliceBytes), LocalReach: g.regions.HostReach, Joined: &g.stats.joined,
			CallTime: g.countEngineCall})
	})
}

// enginePlane is what a guard asks of the engine data plane beyond a data
// plane's calls: its connections per session, the calls still running,
// and the quiesce of a session's writes.
type enginePlane interface {
	transport.Transport
	Conn(session string) transport.Conn
	ConnChecked(session string, peer transport.Conn) transport.Conn
	Engine() string
	InFlight() int64
	WaitTransfer(ctx context.Context, transfer uint64) error
	QuiesceSession(ctx context.Context, session string, regions []memory.Region) error
}

// mooncakeSliceSize is Mooncake's default slice (its MC_SLICE_SIZE unset).
const mooncakeSliceSize = 65536

// engineSliceBytes is the slice size the engine cuts requests into, where
// known: Mooncake's MC_SLICE_SIZE read as Mooncake reads it (atoi; a value
// that is not positive keeps 64 KiB).
func engineSliceBytes(name string, getenv func(string) string) int {
	if !strings.EqualFold(name, "mooncake") {
		return 0
	}
	if v := atoi(getenv("MC_SLICE_SIZE")); v > 0 {
		return v
	}
	return mooncakeSliceSize
}

// atoi is C's: leading blanks, a sign, then digits up to the first other
// character; 0 when there are none.
func atoi(s string) int {
	s = strings.TrimLeft(s, " \t\n\v\f\r")
	end := 0
	if end < len(s) && (s[end] == '+' || s[end] == '-') {
		end++
	}
	for end < len(s) && s[end] >= '0' && s[end] <= '9' {
		end++
	}
	v, err := strconv.Atoi(s[:end])
	if err != nil {
		return 0
	}
	return v
}

// SetPeerGuard tells a guard over an engine where the guard of the peer
// it names session listens: completion notices (digest mode), notifies
// and the peer's region table go there. Over mcguard's own data planes
// the session's name is that endpoint already.
func (g *Guard) SetPeerGuard(session, endpoint string) error {
	if err := g.enterSession(session); err != nil {
		return err
	}
	defer g.leave()
	if err := control.ValidSessionName(endpoint); err != nil {
		return fmt.Errorf("peer guard endpoint: %w", err)
	}
	if g.engine == nil {
		return fmt.Errorf("%w: this guard sends over mcguard's %s data plane, where the session's name is its guard's endpoint; SetPeerGuard is for guards over an engine", errs.InvalidArg, g.data.Name())
	}
	s := g.session(session)
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.control != endpoint {
		s.disconnect()
		s.control, s.hello, s.seq = endpoint, control.HelloReply{}, 0
	}
	return nil
}

// maxEngineWait bounds WaitEngineCalls' timeout.
const maxEngineWait = 24 * time.Hour

// WaitEngineCalls returns once no engine call this guard made for
// transfer id (a failed one's, say) is still running, held writes
// included, or fails with ErrTimeout after timeout (0: do not wait, only
// say). It waits for that transfer's calls only: other transfers may keep
// the engine busy meanwhile (stats' engine_calls_in_flight counts them
// all). Over an engine nothing at the receiver can refuse a late write, so
// before writing a failed transfer's blocks again an application waits for
// this. It cannot see slices the engine runs after its call returned.
// Over mcguard's own data planes a failed transfer's abort state says
// whether more can land, and the receiver's Quiesce makes sure: there it
// is ErrInvalidArg.
func (g *Guard) WaitEngineCalls(id uint64, timeout time.Duration) error {
	if err := g.enter(); err != nil {
		return err
	}
	defer g.leave()
	switch {
	case g.engine == nil:
		return fmt.Errorf("%w: this guard sends over mcguard's %s data plane, where a failed transfer's abort state says whether more of it can land and the receiver's quiesce makes sure; waiting for engine calls is for guards over an engine", errs.InvalidArg, g.data.Name())
	case !g.ids.gave(id):
		return fmt.Errorf("%w: transfer id %#x was not given by this guard", errs.InvalidArg, id)
	case timeout < 0 || timeout > maxEngineWait:
		return fmt.Errorf("%w: timeout %v is outside [0, %v]", errs.InvalidArg, timeout, maxEngineWait)
	}
	ctx, cancel := context.WithTimeout(g.ctx, timeout)
	defer cancel()
	if err := g.engine.WaitTransfer(ctx, id); err != nil {
		if g.ctx.Err() != nil {
			return fmt.Errorf("%w while waiting for the engine calls of transfer %#x", errs.Closed, id)
		}
		return err
	}
	return nil
}

// QuiesceEngine keeps, at this sending guard over an engine, a quiesce of
// ranges (the receiver's addresses) that the receiver at session took and
// the application brought here over its own channel: from now on no
// engine call of a transfer that began before it writes into them (such a
// transfer fails with ErrQuiesced, held writes are dropped), and it
// returns once no engine call to session of such a transfer still runs,
// or fails with ErrTimeout at sync_timeout. The receiver's guard cannot
// do this itself: the engine writes into its memory without mcguard.
// Slices the engine runs after its call returned stay beyond it. Over
// mcguard's own data planes the receiver's Quiesce does it: there it is
// ErrInvalidArg.
func (g *Guard) QuiesceEngine(session string, ranges []SyncRange) error {
	if err := g.enter(); err != nil {
		return err
	}
	defer g.leave()
	switch {
	case g.engine == nil:
		return fmt.Errorf("%w: this guard sends over mcguard's %s data plane, where the receiver's own quiesce refuses late writes; quiescing at the sender is for guards over an engine", errs.InvalidArg, g.data.Name())
	case session == "":
		return fmt.Errorf("%w: empty session name", errs.InvalidArg)
	case len(ranges) == 0 || len(ranges) > MaxDescriptors:
		return fmt.Errorf("%w: %d ranges (1 to %d)", errs.InvalidArg, len(ranges), MaxDescriptors)
	}
	regions := make([]memory.Region, len(ranges))
	for i, r := range ranges {
		if r.Len == 0 || r.Addr+r.Len < r.Addr {
			return fmt.Errorf("%w: range %d [%#x, +%d) is empty or wraps", errs.InvalidArg, i, r.Addr, r.Len)
		}
		regions[i] = memory.Region(r)
	}
	ctx, cancel := context.WithTimeout(g.ctx, g.cfg.SyncTimeout)
	defer cancel()
	if err := g.engine.QuiesceSession(ctx, session, regions); err != nil {
		if g.ctx.Err() != nil {
			return fmt.Errorf("%w while quiescing the engine's writes to %s", errs.Closed, session)
		}
		return err
	}
	g.stats.quiesces.Add(1)
	g.metrics.quiesces.Add(1)
	return nil
}
