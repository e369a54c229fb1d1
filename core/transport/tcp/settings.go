package tcp

import (
	"time"

	"github.com/mcguard/mcguard/core/config"
)

// Settings are the TCP data plane's own settings, as an operator sets them.
type Settings struct {
	// Stripes is the data connections per session that a large batch is
	// striped over (1 to MaxStripes; 0 means 1): see stripes.go.
	Stripes int
	// BusyPoll is how long a read that expects bytes soon spins before its
	// thread sleeps (0: never; at most MaxBusyPoll; a wake-up costs tens
	// of µs on a VM): see spin.go.
	BusyPoll time.Duration
}

// DefaultSettings are the settings where nothing is set.
func DefaultSettings() Settings { return Settings{Stripes: 1, BusyPoll: 50 * time.Microsecond} }

// Load reads tcp_stripes (MC_GUARD_TCP_STRIPES) and busy_poll_us
// (MC_GUARD_BUSY_POLL_US) over s.
func (s *Settings) Load(l *config.Loader) {
	l.Int("tcp_stripes", []string{"MC_GUARD_TCP_STRIPES"}, &s.Stripes, 1, MaxStripes)
	l.Micros("busy_poll_us", []string{"MC_GUARD_BUSY_POLL_US"}, &s.BusyPoll, MaxBusyPoll)
}
