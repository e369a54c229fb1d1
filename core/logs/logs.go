// Package logs is where the library's messages go: a process-wide level,
// and a sink — standard error by default, the host's logger when it sets
// one (the C callback of mc_guard_set_log; the Python binding routes it
// into logging.getLogger("mcguard")). By default only warnings and errors
// pass, and the library warns only of fault injection and of listening
// without a secret.
package logs

import (
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"
)

// Level orders messages; a message passes when its level is at most the
// level set. The numbers are the header's MC_LOG_*.
type Level int32

const (
	Error Level = iota
	Warn
	Info
	Debug
)

// Levels names the levels in order.
var Levels = []string{"error", "warn", "info", "debug"}

func (l Level) String() string { return Levels[l] }

// ParseLevel reads a level's name.
func ParseLevel(s string) (Level, error) {
	for i, name := range Levels {
		if strings.EqualFold(strings.TrimSpace(s), name) {
			return Level(i), nil
		}
	}
	return 0, fmt.Errorf("log level %q is not one of %s", s, strings.Join(Levels, ", "))
}

// Sink receives the messages that pass.
type Sink func(Level, string)

var (
	level atomic.Int32 // Warn unless set
	mu    sync.RWMutex
	sink  Sink = toStderr
)

func init() { level.Store(int32(Warn)) }

func toStderr(l Level, msg string) { fmt.Fprintf(os.Stderr, "mcguard: %s: %s\n", l, msg) }

// SetLevel sets the level for the process.
func SetLevel(l Level) { level.Store(int32(l)) }

// CurrentLevel is the level set.
func CurrentLevel() Level { return Level(level.Load()) }

// SetSink sends the messages to s from now on; nil is standard error.
func SetSink(s Sink) {
	if s == nil {
		s = toStderr
	}
	mu.Lock()
	sink = s
	mu.Unlock()
}

// Printf formats a message at level l and hands it to the sink when l passes.
func Printf(l Level, format string, args ...any) {
	if l > CurrentLevel() {
		return
	}
	msg := fmt.Sprintf(format, args...)
	mu.RLock()
	s := sink
	mu.RUnlock()
	s(l, msg)
}

// Once logs its first message only: a fallback that every later call
// takes too is said once per process.
type Once struct{ once sync.Once }

// Printf logs as Printf does, the first time only.
func (o *Once) Printf(l Level, format string, args ...any) {
	o.once.Do(func() { Printf(l, format, args...) })
}
