package core

import (
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/core/desc"
	"github.com/mcguard/mcguard/core/errs"
)

// The metrics say what happened, by mode and outcome, in the text format.
func TestMetrics(t *testing.T) {
	p := newPair(t, "", "", 16*4096)
	fill(p.src.b)
	for i := 0; i < 3; i++ {
		_, err := p.send.Transfer(p.recv.Endpoint(), p.blocks(16, 4096), TransferOptions{})
		require.NoError(t, err)
	}
	_, err := p.send.Transfer(p.recv.Endpoint(), []desc.Desc{{Src: p.src.addr(0), Dst: p.dst.addr(0) + 1<<30, Len: 8}}, TransferOptions{})
	require.ErrorIs(t, err, errs.NotRegistered)
	require.NoError(t, p.recv.Sync([]SyncRange{{p.dst.addr(0), 4096}}, nil, 0))
	send, err := p.send.Metrics()
	require.NoError(t, err)
	recv, err := p.recv.Metrics()
	require.NoError(t, err)
	for _, line := range []string{
		`mcguard_transfers_total{mode="tail",outcome="ok"} 3`,
		`mcguard_transfers_total{mode="tail",outcome="not_registered"} 1`,
		`mcguard_descriptors_total{mode="tail"} 48`,
		fmt.Sprintf(`mcguard_transferred_bytes_total{mode="tail"} %d`, 3*16*4096),
		`mcguard_transfer_seconds_count{mode="tail"} 4`,
		`mcguard_transfer_seconds_bucket{mode="tail",le="+Inf"} 4`,
		`mcguard_verification_seconds_count{mode="tail"} 3`,
		`mcguard_sessions 1`,
		`mcguard_engine_calls_in_flight 0`,
		"# TYPE mcguard_transfer_seconds histogram",
	} {
		require.Contains(t, string(send), line+"\n")
	}
	for _, line := range []string{
		`mcguard_handshakes_total{outcome="ok"}`,
		`mcguard_syncs_total{outcome="ok"} 1`,
		`mcguard_connections 1`,
	} {
		require.Contains(t, string(recv), line)
	}
	for _, l := range strings.Split(strings.TrimSpace(string(send)), "\n") {
		require.True(t, strings.HasPrefix(l, "# ") || strings.HasPrefix(l, "mcguard_"), l)
	}
}
