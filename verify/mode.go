// Package verify decides what "delivered" means: which bytes of a transfer
// are read back from the target and how often they are polled (check.go),
// what a chunk's delivery does in each mode, when a notice is sent and
// how digests are compared (deliver.go, digest.go), and the settings that
// choose all this (mode.go).
package verify

import (
	"fmt"
	"strings"
	"time"

	"github.com/mcguard/mcguard/core/config"
	"github.com/mcguard/mcguard/core/errs"
)

// Mode names a verification policy.
type Mode string

const (
	// Off checks nothing: the regression baseline that shows the bug.
	Off Mode = "off"
	// Tail reads back the last TailBytes of every descriptor and polls until
	// they equal the source's (the vLLM Mooncake connector's guard).
	Tail Mode = "tail"
	// Sample reads back the head, the tail and SampleStripes stripes of
	// SampleBytes at offsets drawn from a seed that changes per transfer.
	Sample Mode = "sample"
	// Full reads back every byte.
	Full Mode = "full"
	// Digest reads nothing back: the sender sends an xxh3-64 digest per
	// descriptor with its completion notice and the receiver compares them
	// with digests of its destinations in mc_guard_sync.
	Digest Mode = "digest"
)

// Modes lists the modes in the order the C header numbers them.
var Modes = []Mode{Off, Tail, Sample, Full, Digest}

// ReadsBack reports whether the sender checks the mode by reading back.
func (m Mode) ReadsBack() bool { return m == Tail || m == Sample || m == Full }

// OnMismatch choices.
const (
	Fail   = "fail"   // return MC_ERR_VERIFY
	Resend = "resend" // write the failing descriptors again, up to MaxResends times
)

// Config holds the verification knobs.
type Config struct {
	Mode          Mode
	TailBytes     int
	SampleStripes int
	SampleBytes   int
	MaxRetries    int
	RetrySleep    time.Duration
	OnMismatch    string
	MaxResends    int
	// Notify is one of NotifyAuto, NotifyAlways, NotifyNever.
	Notify string
	// SliceBytes > 0 makes tail and sample check the tail of every
	// SliceBytes slice of a descriptor, not only its last: for engines
	// that cut a request into slices and move them on different paths, so
	// the last bytes arriving say nothing of the rest. 0 checks each
	// descriptor whole; SliceAuto leaves it to the data plane (an
	// engine's own slice size, else 0).
	SliceBytes int
}

// SliceAuto is SliceBytes unset: the data plane decides.
const SliceAuto = -1

// Defaults are the vLLM guard's defaults, and sample's.
func Defaults() Config {
	return Config{Mode: Tail, TailBytes: 64, SampleStripes: 4, SampleBytes: 64,
		MaxRetries: 500, RetrySleep: time.Millisecond, OnMismatch: Fail, MaxResends: 3, Notify: NotifyAuto,
		SliceBytes: SliceAuto}
}

const vllmPrefix = "VLLM_MOONCAKE_TRANSFER_VERIFY"

// Load reads the verification settings from l on top of Defaults. The vLLM
// variables keep working; MC_GUARD_* override them; JSON overrides both.
func Load(l *config.Loader) Config {
	c := Defaults()
	mode := string(c.Mode)
	names := make([]string, len(Modes))
	for i, m := range Modes {
		names[i] = string(m)
	}
	bools := map[string]string{"true": "tail", "1": "tail", "yes": "tail", "on": "tail",
		"false": "off", "0": "off", "no": "off", "none": "off"}
	l.Choice("verify", []string{vllmPrefix, "MC_GUARD_VERIFY"}, &mode, names, bools)
	c.Mode = Mode(mode)
	l.Int("tail_bytes", []string{vllmPrefix + "_TAIL_BYTES", "MC_GUARD_TAIL_BYTES"}, &c.TailBytes, 1, 1<<20)
	l.Int("max_retries", []string{vllmPrefix + "_MAX_RETRIES", "MC_GUARD_MAX_RETRIES"}, &c.MaxRetries, 0, 1<<24)
	l.Seconds("retry_sleep_s", []string{vllmPrefix + "_RETRY_SLEEP_S", "MC_GUARD_RETRY_SLEEP_S"}, &c.RetrySleep, time.Minute)
	l.Int("sample_stripes", []string{"MC_GUARD_SAMPLE_STRIPES"}, &c.SampleStripes, 0, 1024)
	l.Int("sample_bytes", []string{"MC_GUARD_SAMPLE_BYTES"}, &c.SampleBytes, 1, 1<<20)
	l.Choice("on_mismatch", []string{"MC_GUARD_ON_MISMATCH"}, &c.OnMismatch, []string{Fail, Resend}, nil)
	l.Int("max_resends", []string{"MC_GUARD_MAX_RESENDS"}, &c.MaxResends, 0, 1000)
	l.Choice("notify", []string{"MC_GUARD_NOTIFY"}, &c.Notify, []string{NotifyAuto, NotifyAlways, NotifyNever}, nil)
	l.Int("slice_bytes", []string{"MC_GUARD_SLICE_BYTES"}, &c.SliceBytes, 0, 1<<40)
	return c
}

// ParseMode turns a mode name into a Mode.
func ParseMode(s string) (Mode, error) {
	s = strings.ToLower(strings.TrimSpace(s))
	for _, m := range Modes {
		if string(m) == s {
			return m, nil
		}
	}
	return "", fmt.Errorf("%w: unknown verify mode %q", errs.Config, s)
}
