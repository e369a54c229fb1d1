package core

import (
	"bytes"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/verify"
)

// The stats say where a transfer's time went: in the library, in the
// engine's own calls (the metrics' mcguard_engine_call_seconds too) and in
// the checks after the writes, and at the receiver in its sync calls. An
// engine whose every write takes at least 2 ms shows them apart.
func TestStatsSayWhereTheTimeWent(t *testing.T) {
	const transfers, slow = 4, 2 * time.Millisecond
	f := newFakeEngines()
	f.slow = slow
	p := newEnginePair(t, `{"verify": "tail"}`, "", 64*4096, f)

	for range transfers {
		fill(p.src.b)
		res, err := p.send.Transfer(p.session, p.blocks(64, 4096), TransferOptions{Verify: ptr(verify.Digest)})
		require.NoError(t, err)
		require.NoError(t, p.recv.SyncTransfers([]uint64{res.ID}, 0), "the receiver compares the digests")
		require.True(t, bytes.Equal(p.src.b, p.dst.b))
	}

	st := stats(t, p.send)
	engineNanos, transferNanos, checkNanos := st["engine_call_ns"].(float64), st["transfer_ns"].(float64), st["check_ns"].(float64)
	require.EqualValues(t, transfers, st["engine_calls"], "one write call per transfer; no read-back goes through the engine")
	require.GreaterOrEqual(t, engineNanos, float64(transfers*slow), "every engine call's time is counted")
	require.GreaterOrEqual(t, transferNanos, engineNanos+checkNanos, "the engine's calls and the checks are parts of the transfers")
	require.Positive(t, checkNanos, "digest mode fences each chunk after its writes")
	require.Zero(t, st["sync_calls"], "the sender synced nothing")

	m, err := p.send.Metrics()
	require.NoError(t, err)
	require.Contains(t, string(m), fmt.Sprintf("mcguard_engine_call_seconds_count %d\n", transfers), "each engine call in the metrics too")

	rt := stats(t, p.recv)
	require.EqualValues(t, transfers, rt["sync_calls"])
	require.Positive(t, rt["sync_ns"])
	require.Zero(t, rt["transfer_ns"], "the receiver sent nothing")
	_, hasEngine := rt["engine_calls"]
	require.False(t, hasEngine, "a guard without an engine has no engine calls to count")
}
