package config

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/core/errs"
)

func envOf(m map[string]string) Getenv {
	return func(k string) (string, bool) { v, ok := m[k]; return v, ok }
}

func TestLoaderLayersAndErrors(t *testing.T) {
	var n int
	var s string
	l, err := NewLoader(envOf(map[string]string{"A": "1", "B": "2", "S": "env"}), `{"n": 3, "s": "json"}`)
	require.NoError(t, err)
	l.Int("n", []string{"A", "B"}, &n, 0, 10)
	l.String("s", []string{"S"}, &s)
	require.NoError(t, l.Err())
	require.Equal(t, 3, n, "JSON beats env")
	require.Equal(t, "json", s)

	l, err = NewLoader(envOf(map[string]string{"A": "1", "B": "2"}), "")
	require.NoError(t, err)
	l.Int("n", []string{"A", "B"}, &n, 0, 10)
	require.Equal(t, 2, n, "the later variable wins")

	l, err = NewLoader(envOf(map[string]string{"A": "11"}), `{"x": 1}`)
	require.NoError(t, err)
	l.Int("n", []string{"A"}, &n, 0, 10)
	err = l.Err()
	require.ErrorIs(t, err, errs.Config)
	require.Contains(t, err.Error(), "n (from env A): want an integer in [0, 10]")
	require.Contains(t, err.Error(), `unknown config key "x"`)

	for _, js := range []string{"[1]", "{", `{"a":1} {}`, "nul"} {
		_, err := NewLoader(nil, js)
		require.ErrorIs(t, err, errs.Config, js)
	}
}

func TestMicrosReadsWholeMicrosecondsWithinItsBound(t *testing.T) {
	d := 50 * time.Microsecond
	l, err := NewLoader(envOf(nil), "")
	require.NoError(t, err)
	l.Micros("us", []string{"US"}, &d, time.Millisecond)
	require.NoError(t, l.Err())
	require.Equal(t, 50*time.Microsecond, d, "unset: the default stays")

	l, err = NewLoader(envOf(map[string]string{"US": "0"}), `{"us": 200}`)
	require.NoError(t, err)
	l.Micros("us", []string{"US"}, &d, time.Millisecond)
	require.NoError(t, l.Err())
	require.Equal(t, 200*time.Microsecond, d)

	for _, bad := range []string{"1001", "-1", "2.5"} {
		d = 50 * time.Microsecond
		l, err = NewLoader(envOf(map[string]string{"US": bad}), "")
		require.NoError(t, err)
		l.Micros("us", []string{"US"}, &d, time.Millisecond)
		require.ErrorContains(t, l.Err(), "want an integer in [0, 1000]", bad)
		require.Equal(t, 50*time.Microsecond, d, bad)
	}
}
