package logs

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestLevelsAndSink(t *testing.T) {
	var got []string
	SetSink(func(l Level, msg string) { got = append(got, l.String()+" "+msg) })
	defer SetSink(nil)
	defer SetLevel(CurrentLevel())
	SetLevel(Warn)
	Printf(Info, "quiet %d", 1)
	Printf(Warn, "loud %d", 2)
	require.Equal(t, []string{"warn loud 2"}, got)
	SetLevel(Debug)
	Printf(Info, "now %s", "heard")
	require.Equal(t, "info now heard", got[1])
	l, err := ParseLevel(" INFO ")
	require.NoError(t, err)
	require.Equal(t, Info, l)
	_, err = ParseLevel("loud")
	require.ErrorContains(t, err, "error, warn, info, debug")
}
