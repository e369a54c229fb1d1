// Package config reads settings in layers: built-in defaults, environment
// variables, then the JSON object given to mc_guard_open. It knows no
// setting itself; core and verify declare theirs through a Loader.
package config

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/mcguard/mcguard/core/errs"
)

// Getenv looks up one environment variable. The C library passes a lookup
// that reads the live C environment (Go's copy is taken at load time and
// misses variables a Python program sets later).
type Getenv func(name string) (string, bool)

// Loader reads settings in layers: built-in default, then each environment
// variable named for the key in the order given, then the JSON key. The
// last layer that is present wins, so JSON beats env and MC_GUARD_* beats
// the vLLM names when both are listed in that order.
type Loader struct {
	getenv Getenv
	json   map[string]json.RawMessage
	used   map[string]bool
	errs   []string
}

// NewLoader parses configJSON (empty means {}) and returns a loader over it.
func NewLoader(getenv Getenv, configJSON string) (*Loader, error) {
	if getenv == nil {
		getenv = func(string) (string, bool) { return "", false }
	}
	l := &Loader{getenv: getenv, json: map[string]json.RawMessage{}, used: map[string]bool{}}
	if strings.TrimSpace(configJSON) == "" {
		return l, nil
	}
	dec := json.NewDecoder(strings.NewReader(configJSON))
	dec.UseNumber()
	if err := dec.Decode(&l.json); err != nil {
		return nil, fmt.Errorf("%w: config JSON must be one object: %v", errs.Config, err)
	}
	if dec.More() {
		return nil, fmt.Errorf("%w: config JSON has data after its object", errs.Config)
	}
	return l, nil
}

// raw returns the winning textual value of key and where it came from.
// JSON strings are unquoted; other JSON values are returned as written.
func (l *Loader) raw(key string, envs []string) (value, source string, ok bool) {
	for _, name := range envs {
		if v, found := l.getenv(name); found && v != "" {
			value, source, ok = v, "env "+name, true
		}
	}
	if msg, found := l.json[key]; found {
		l.used[key] = true
		var s string
		if err := json.Unmarshal(msg, &s); err == nil {
			return s, "JSON key " + key, true
		}
		return string(bytes.TrimSpace(msg)), "JSON key " + key, true
	}
	return value, source, ok
}

func (l *Loader) fail(key, source, want, got string) {
	l.errs = append(l.errs, fmt.Sprintf("%s (from %s): want %s, got %q", key, source, want, got))
}

// Int reads an integer setting in [min, max].
func (l *Loader) Int(key string, envs []string, dst *int, min, max int) {
	v, src, ok := l.raw(key, envs)
	if !ok {
		return
	}
	n, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
	if err != nil || n < int64(min) || n > int64(max) {
		l.fail(key, src, fmt.Sprintf("an integer in [%d, %d]", min, max), v)
		return
	}
	*dst = int(n)
}

// Float reads a number in [min, max].
func (l *Loader) Float(key string, envs []string, dst *float64, min, max float64) {
	v, src, ok := l.raw(key, envs)
	if !ok {
		return
	}
	f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
	if err != nil || math.IsNaN(f) || f < min || f > max {
		l.fail(key, src, fmt.Sprintf("a number in [%g, %g]", min, max), v)
		return
	}
	*dst = f
}

// Bool reads a true/false setting (also 1/0, yes/no, on/off).
func (l *Loader) Bool(key string, envs []string, dst *bool) {
	v, src, ok := l.raw(key, envs)
	if !ok {
		return
	}
	switch strings.ToLower(strings.TrimSpace(v)) {
	case "true", "1", "yes", "on":
		*dst = true
	case "false", "0", "no", "off":
		*dst = false
	default:
		l.fail(key, src, "true or false", v)
	}
}

// Seconds reads a duration given in (fractional) seconds, in [0, max].
func (l *Loader) Seconds(key string, envs []string, dst *time.Duration, max time.Duration) {
	l.duration(key, envs, dst, max, time.Second, "seconds")
}

// Millis reads a duration given in (fractional) milliseconds, in [0, max].
func (l *Loader) Millis(key string, envs []string, dst *time.Duration, max time.Duration) {
	l.duration(key, envs, dst, max, time.Millisecond, "milliseconds")
}

// Micros reads a duration given in whole microseconds, in [0, max].
func (l *Loader) Micros(key string, envs []string, dst *time.Duration, max time.Duration) {
	us := int(*dst / time.Microsecond)
	l.Int(key, envs, &us, 0, int(max/time.Microsecond))
	*dst = time.Duration(us) * time.Microsecond
}

func (l *Loader) duration(key string, envs []string, dst *time.Duration, max, unit time.Duration, unitName string) {
	v, src, ok := l.raw(key, envs)
	if !ok {
		return
	}
	f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
	limit := float64(max) / float64(unit)
	if err != nil || math.IsNaN(f) || f < 0 || f > limit {
		l.fail(key, src, fmt.Sprintf("a number of %s in [0, %g]", unitName, limit), v)
		return
	}
	*dst = time.Duration(f * float64(unit))
}

// String reads a free-form string setting.
func (l *Loader) String(key string, envs []string, dst *string) {
	if v, _, ok := l.raw(key, envs); ok {
		*dst = v
	}
}

// Choice reads a setting that must be one of choices; aliases maps other
// accepted spellings (such as "true") onto a choice.
func (l *Loader) Choice(key string, envs []string, dst *string, choices []string, aliases map[string]string) {
	v, src, ok := l.raw(key, envs)
	if !ok {
		return
	}
	w := strings.ToLower(strings.TrimSpace(v))
	if a, found := aliases[w]; found {
		w = a
	}
	for _, c := range choices {
		if w == c {
			*dst = c
			return
		}
	}
	l.fail(key, src, "one of "+strings.Join(choices, ", "), v)
}

// Err reports every bad value and every JSON key that no setting claimed.
func (l *Loader) Err() error {
	problems := append([]string(nil), l.errs...)
	var unknown []string
	for k := range l.json {
		if !l.used[k] {
			unknown = append(unknown, k)
		}
	}
	sort.Strings(unknown)
	for _, k := range unknown {
		problems = append(problems, fmt.Sprintf("unknown config key %q", k))
	}
	if len(problems) == 0 {
		return nil
	}
	return fmt.Errorf("%w: %s", errs.Config, strings.Join(problems, "; "))
}
