package verify

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"time"
)

// Mode names a verification policy.
type Mode string

const (
	// Off checks nothing: the regression baseline that shows the bug.
	Off Mode = "off"
	// Tail reads back the last TailBytes of every descriptor and polls until
	// they equal the source's (the vLLM Mooncake connector's guard).
	Tail Mode = "tail"
)

// Modes lists the modes in the order the C header numbers them.
var Modes = []Mode{Off, Tail}

// Config holds the verification knobs.
type Config struct {
	Mode       Mode
	TailBytes  int
	MaxRetries int
	RetrySleep time.Duration
}

// Defaults are the vLLM guard's defaults.
func Defaults() Config {
	return Config{Mode: Tail, TailBytes: 64, MaxRetries: 500, RetrySleep: time.Millisecond}
}

const vllmPrefix = "VLLM_MOONCAKE_TRANSFER_VERIFY"

// Load reads the verification settings from l on top of Defaults. The vLLM
// variables keep working; MC_GUARD_* override them; JSON overrides both.
func Load(l *Loader) Config {
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
	return c
}

// ParseMode turns a mode name into a Mode.
func ParseMode(s string) (Mode, error) {
	for _, m := range Modes {
		if string(m) == s {
			return m, nil
		}
	}
	return "", fmt.Errorf("%w: unknown verify mode %q", ErrConfig, s)
}

// Desc is one transfer descriptor: Len bytes from local Src to remote Dst.
type Desc struct {
	Src, Dst, Len uint64
}

// Range is a span of remote memory to read back.
type Range struct {
	Addr, Len uint64
}

// ReadFunc reads the remote ranges, concatenated in order, into out in one
// round trip; len(out) is the sum of the ranges' lengths.
type ReadFunc func(ctx context.Context, ranges []Range, out []byte) error

// LocalFunc returns the local source bytes [addr, addr+n), already checked
// to lie in registered memory.
type LocalFunc func(addr, n uint64) []byte

// Scratch is the read-back buffer of one session. A session owns its own,
// so two sessions verifying at once never share bytes.
type Scratch struct {
	buf []byte
}

// Bytes returns n bytes of scratch, growing it when needed.
func (s *Scratch) Bytes(n uint64) []byte {
	if uint64(cap(s.buf)) < n {
		s.buf = make([]byte, n)
	}
	return s.buf[:n]
}

// ErrMismatch marks a verification that ran out of retries.
var ErrMismatch = errors.New("verification failed")

// MismatchError names the descriptors whose bytes never matched.
type MismatchError struct {
	Descs   []int // indices into the batch, ascending
	Retries int
}

func (e *MismatchError) Error() string {
	shown := e.Descs
	more := ""
	if len(shown) > 16 {
		shown, more = shown[:16], fmt.Sprintf(" and %d more", len(e.Descs)-16)
	}
	parts := make([]string, len(shown))
	for i, d := range shown {
		parts[i] = fmt.Sprint(d)
	}
	return fmt.Sprintf("%v: %d descriptor(s) still differ at the target after %d retries: [%s]%s",
		ErrMismatch, len(e.Descs), e.Retries, strings.Join(parts, " "), more)
}

func (e *MismatchError) Unwrap() error { return ErrMismatch }

// probe is one range of one descriptor that is read back and compared.
type probe struct {
	desc     int    // index in the batch
	src, dst uint64 // absolute addresses
	n        uint64
}

// probes lists what cfg reads back for descs; base offsets desc indices.
func probes(cfg Config, descs []Desc, base int) []probe {
	if cfg.Mode == Off {
		return nil
	}
	out := make([]probe, 0, len(descs))
	for i, d := range descs {
		n := min(uint64(cfg.TailBytes), d.Len)
		off := d.Len - n
		out = append(out, probe{desc: base + i, src: d.Src + off, dst: d.Dst + off, n: n})
	}
	return out
}

// Result reports what a Check did.
type Result struct {
	Retries int   // polling rounds after the first read
	Probed  int64 // bytes read back in all rounds
}

// Check confirms descs at the target: it reads back what cfg asks for, in
// one round trip per round, and polls with cfg.RetrySleep between rounds
// until every probe equals its source or cfg.MaxRetries rounds have passed.
// base is the index of descs[0] in the caller's batch, used in errors.
func Check(ctx context.Context, cfg Config, descs []Desc, base int, local LocalFunc, remote ReadFunc, scratch *Scratch) (Result, error) {
	pending := probes(cfg, descs, base)
	var res Result
	ranges := make([]Range, 0, len(pending))
	for round := 0; ; round++ {
		if len(pending) == 0 {
			return res, nil
		}
		ranges = ranges[:0]
		var total uint64
		for _, p := range pending {
			ranges = append(ranges, Range{Addr: p.dst, Len: p.n})
			total += p.n
		}
		buf := scratch.Bytes(total)
		if err := remote(ctx, ranges, buf); err != nil {
			return res, err
		}
		res.Probed += int64(total)
		still := pending[:0]
		var off uint64
		for _, p := range pending {
			if !bytes.Equal(buf[off:off+p.n], local(p.src, p.n)) {
				still = append(still, p)
			}
			off += p.n
		}
		pending = still
		if len(pending) == 0 {
			return res, nil
		}
		if round >= cfg.MaxRetries {
			return res, mismatch(pending, res.Retries)
		}
		res.Retries++
		if err := sleep(ctx, cfg.RetrySleep); err != nil {
			return res, err
		}
	}
}

func mismatch(pending []probe, retries int) error {
	e := &MismatchError{Retries: retries}
	for _, p := range pending {
		if len(e.Descs) == 0 || e.Descs[len(e.Descs)-1] != p.desc {
			e.Descs = append(e.Descs, p.desc)
		}
	}
	return e
}

func sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
