package core

import (
	"bytes"
	"runtime"
	"testing"

	"github.com/stretchr/testify/require"
)

// Busy polling shows in stats: with it on, a run of small transfers over
// the socket spins and most spins pay (the answer comes while spinning);
// with busy_poll_us 0 nothing spins. Either way every byte arrives.
func TestBusyPollingIsCounted(t *testing.T) {
	if runtime.GOMAXPROCS(0) < 2 {
		t.Skip("one P: nothing spins")
	}
	for _, budget := range []string{"50", "0"} {
		t.Run(budget, func(t *testing.T) {
			cfg := `{"verify": "tail", "same_host": "off", "busy_poll_us": ` + budget + `}`
			p := newPair(t, cfg, `{"busy_poll_us": `+budget+`}`, 64<<10)
			fill(p.src.b)
			for range 200 {
				_, err := p.send.Transfer(p.recv.Endpoint(), p.blocks(16, 4096), TransferOptions{})
				require.NoError(t, err)
			}
			require.True(t, bytes.Equal(p.src.b, p.dst.b))
			s := stats(t, p.send)
			require.EqualValues(t, map[string]int{"50": 50, "0": 0}[budget], s["busy_poll_us"])
			spins, paid := s["busy_poll_spins"].(float64), s["busy_poll_paid"].(float64)
			if budget == "0" {
				require.Zero(t, spins)
				require.Zero(t, stats(t, p.recv)["busy_poll_spins"])
				return
			}
			require.Positive(t, spins, "the sender spun waiting for its answers")
			require.LessOrEqual(t, paid, spins)
			require.Positive(t, s["busy_poll_spent_us"])
		})
	}
}
