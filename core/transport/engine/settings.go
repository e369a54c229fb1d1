package engine

import (
	"time"

	"github.com/mcguard/mcguard/core/config"
)

// Settings are the engine data plane's own settings, as an operator sets them.
type Settings struct {
	// InlineCalls: each callback runs on the calling thread (no hand-off
	// to another one: tens of µs less per call on a VM), and a call past
	// its deadline fails only once it returns. By default each runs apart
	// and the transfer returns at its deadline (timeout_ms per call without
	// one) even if the callback never does.
	InlineCalls bool
	// PeerChecks: where the peer's guard is known (SetPeerGuard), read-backs
	// are answered by that guard from its own memory over mcguard's own
	// connection, and completion notices go on it, instead of each read
	// being another trip through the engine. Off: through the engine.
	PeerChecks bool
	// BusyPoll is how long a thread that runs engine calls waits awake for
	// the next one, and a caller for a call's answer, before sleeping
	// (0: never; at most MaxBusyPoll). Waking a thread costs tens of µs
	// on a VM, more than a small call.
	BusyPoll time.Duration
}

// MaxBusyPoll bounds engine_busy_poll_us.
const MaxBusyPoll = time.Millisecond

// DefaultSettings are the engine data plane's defaults.
func DefaultSettings() Settings { return Settings{PeerChecks: true, BusyPoll: 200 * time.Microsecond} }

// Load reads engine_inline_calls (MC_GUARD_ENGINE_INLINE_CALLS),
// engine_peer_checks (MC_GUARD_ENGINE_PEER_CHECKS) and
// engine_busy_poll_us (MC_GUARD_ENGINE_BUSY_POLL_US) over s.
func (s *Settings) Load(l *config.Loader) {
	l.Bool("engine_inline_calls", []string{"MC_GUARD_ENGINE_INLINE_CALLS"}, &s.InlineCalls)
	l.Bool("engine_peer_checks", []string{"MC_GUARD_ENGINE_PEER_CHECKS"}, &s.PeerChecks)
	l.Micros("engine_busy_poll_us", []string{"MC_GUARD_ENGINE_BUSY_POLL_US"}, &s.BusyPoll, MaxBusyPoll)
}
