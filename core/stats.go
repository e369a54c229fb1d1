package core

import (
	"encoding/json"
	"sync/atomic"
	"time"
)

// Counters and the stats JSON.

type counters struct {
	transfers, ok, failed, descriptors, bytes, retries, resends, verifyFailures, probed atomic.Int64
	noticesSent, noticesReceived, noticesUndelivered, syncs, syncFailures               atomic.Int64
	cancels, abortsConfirmed, abortsUnconfirmed, abortsAnswered, quiesces               atomic.Int64
	// digest mode's syncs: ranges compared with a digest taken as they
	// landed, and ranges whose memory was read again
	digestsLanded, digestsRead atomic.Int64
	pushed                     atomic.Int64 // bytes written into same-host targets by this process itself
	mapped                     atomic.Int64 // of pushed, those copied into targets' shared allocations (memcpy)
	joined                     atomic.Int64 // descriptors sent inside another descriptor's write (consecutive)
	pipelined                  atomic.Int64 // chunks whose writes went out while the chunk before was checked
	sealsChecked               atomic.Int64 // reads whose landed bytes matched their seal
	sealMismatches             atomic.Int64 // ranges read that differed from their seal
	peerChecked                atomic.Int64 // connections over an engine checked through the peer's guard
	peerCheckFallbacks         atomic.Int64 // ones whose peer's guard could not be reached: through the engine
	// Where the time goes, in ns summed over calls, so that a benchmark
	// can say what a transfer spent where (the means are these over
	// transfers and syncCalls): transfer calls, their chunks' fences and
	// checks after the writes, and the receiver's sync calls.
	transferNanos, checkNanos, syncCalls, syncNanos atomic.Int64
	engineCalls, engineCallNanos                    atomic.Int64 // over an engine: its calls that returned
}

// timeSync counts one sync call that began at start.
func (g *Guard) timeSync(start time.Time) {
	g.stats.syncCalls.Add(1)
	g.stats.syncNanos.Add(int64(time.Since(start)))
}

// countEngineCall counts one call into the application's engine that
// took d, in the stats and the metrics.
func (g *Guard) countEngineCall(d time.Duration) {
	g.stats.engineCalls.Add(1)
	g.stats.engineCallNanos.Add(int64(d))
	g.metrics.engineCallSeconds.Observe(d.Seconds())
}

// Stats returns counters and settings as JSON.
func (g *Guard) Stats() ([]byte, error) {
	if err := g.enter(); err != nil {
		return nil, err
	}
	defer g.leave()
	g.mu.Lock()
	nsessions := len(g.sessions)
	g.mu.Unlock()
	out := map[string]any{
		"endpoint":             g.Endpoint(),
		"verify":               g.cfg.Verify.Mode,
		"inject":               g.cfg.Inject.Mode,
		"transport":            g.data.Name(),
		"max_batch":            g.cfg.MaxBatch,
		"slice_bytes":          g.cfg.Verify.SliceBytes,
		"sessions":             nsessions,
		"regions":              len(g.regions.Snapshot()),
		"transfers":            g.stats.transfers.Load(),
		"ok":                   g.stats.ok.Load(),
		"failed":               g.stats.failed.Load(),
		"descriptors":          g.stats.descriptors.Load(),
		"bytes":                g.stats.bytes.Load(),
		"retries":              g.stats.retries.Load(),
		"resends":              g.stats.resends.Load(),
		"notices_sent":         g.stats.noticesSent.Load(),
		"notices_received":     g.stats.noticesReceived.Load(),
		"notices_undelivered":  g.stats.noticesUndelivered.Load(),
		"syncs":                g.stats.syncs.Load(),
		"sync_failures":        g.stats.syncFailures.Load(),
		"notify":               g.cfg.Verify.Notify,
		"cuda":                 g.cudaState,
		"rdma_qps":             g.cfg.Planes.RDMA.QPs,
		"tcp_stripes":          g.cfg.Planes.TCP.Stripes,
		"post_ahead":           g.cfg.PostAhead,
		"engine_inline_calls":  g.cfg.Planes.Engine.InlineCalls,
		"engine_peer_checks":   g.cfg.Planes.Engine.PeerChecks,
		"engine_busy_poll_us":  g.cfg.Planes.Engine.BusyPoll.Microseconds(),
		"peer_checked":         g.stats.peerChecked.Load(),
		"peer_check_fallbacks": g.stats.peerCheckFallbacks.Load(),
		"busy_poll_us":         g.cfg.Planes.TCP.BusyPoll.Microseconds(),
		"verify_failures":      g.stats.verifyFailures.Load(),
		"probed_bytes":         g.stats.probed.Load(),
		"joined_descriptors":   g.stats.joined.Load(),
		"pipelined_chunks":     g.stats.pipelined.Load(),
		"cancels":              g.stats.cancels.Load(),
		"aborts_confirmed":     g.stats.abortsConfirmed.Load(),
		"aborts_unconfirmed":   g.stats.abortsUnconfirmed.Load(),
		"aborts_answered":      g.stats.abortsAnswered.Load(),
		"quiesces":             g.stats.quiesces.Load(),
		"digests_landed":       g.stats.digestsLanded.Load(),
		"digests_read":         g.stats.digestsRead.Load(),
		"digest_at":            g.cfg.DigestAt,
		"seals_made":           g.seals.Load(),
		"seals_published":      g.published.Len(),
		"seals_checked":        g.stats.sealsChecked.Load(),
		"seal_mismatches":      g.stats.sealMismatches.Load(),
		"transfer_ns":          g.stats.transferNanos.Load(),
		"check_ns":             g.stats.checkNanos.Load(),
		"sync_calls":           g.stats.syncCalls.Load(),
		"sync_ns":              g.stats.syncNanos.Load(),
	}
	if g.engine != nil {
		out["engine_calls"] = g.stats.engineCalls.Load()
		out["engine_call_ns"] = g.stats.engineCallNanos.Load()
	}
	for _, p := range g.planes {
		p.Stats(out)
	}
	out["same_host_pushed_bytes"] = g.stats.pushed.Load()
	out["same_host_mapped_bytes"] = g.stats.mapped.Load()
	out["same_host"] = g.cfg.SameHost
	out["same_host_writer"] = g.cfg.SameHostWriter
	for name, state := range g.planeState { // "tcp": what it runs on; "rdma": that, or why not
		out[name] = state
	}
	return json.Marshal(out)
}
