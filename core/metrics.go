package core

import (
	"errors"
	"strings"

	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/core/metrics"
)

// guardMetrics are what mc_guard_metrics exposes for Prometheus.
type guardMetrics struct {
	reg                *metrics.Registry
	transfers          metrics.Counter // mode, outcome
	descriptors        metrics.Counter // mode
	bytes              metrics.Counter // mode
	mismatches         metrics.Counter
	retries            metrics.Counter
	resends            metrics.Counter
	noticesSent        metrics.Counter
	noticesReceived    metrics.Counter
	noticesUndelivered metrics.Counter
	syncs              metrics.Counter // outcome
	handshakes         metrics.Counter // outcome
	authFailures       metrics.Counter
	refusedWrites      metrics.Counter // reason
	quiesces           metrics.Counter
	aborts             metrics.Counter // state
	transferSeconds    metrics.Histogram
	verifySeconds      metrics.Histogram
	engineCallSeconds  metrics.Histogram
}

func newGuardMetrics(g *Guard) *guardMetrics {
	r := &metrics.Registry{}
	m := &guardMetrics{
		reg:                r,
		transfers:          r.Counter("mcguard_transfers_total", "Transfers by verify mode and outcome (ok, or the failure's status).", "mode", "outcome"),
		descriptors:        r.Counter("mcguard_descriptors_total", "Descriptors of successful transfers.", "mode"),
		bytes:              r.Counter("mcguard_transferred_bytes_total", "Bytes of successful transfers.", "mode"),
		mismatches:         r.Counter("mcguard_verification_mismatches_total", "Transfers whose verification found bytes that differ after every retry and re-send."),
		retries:            r.Counter("mcguard_verification_retries_total", "Polling rounds of read-back verification."),
		resends:            r.Counter("mcguard_resends_total", "Rounds of re-sending descriptors that did not match."),
		noticesSent:        r.Counter("mcguard_notices_sent_total", "Completion notices sent."),
		noticesReceived:    r.Counter("mcguard_notices_received_total", "Completion notices taken from peers."),
		noticesUndelivered: r.Counter("mcguard_notices_undelivered_total", "Completion notices refused, or whose answer was lost, found at the session's next call."),
		syncs:              r.Counter("mcguard_syncs_total", "Receiver syncs by outcome.", "outcome"),
		handshakes:         r.Counter("mcguard_handshakes_total", "Handshake steps answered, by outcome (ok, challenged, refused).", "outcome"),
		authFailures:       r.Counter("mcguard_auth_failures_total", "Peers that failed to prove the shared secret."),
		refusedWrites:      r.Counter("mcguard_refused_peer_writes_total", "Peer writes the target refused, by reason.", "reason"),
		quiesces:           r.Counter("mcguard_quiesces_total", "Quiesces of ranges before reuse."),
		aborts:             r.Counter("mcguard_aborts_total", "Failed transfers' aborts, by state (confirmed, unconfirmed).", "state"),
		transferSeconds:    r.Histogram("mcguard_transfer_seconds", "Time of a transfer call, by verify mode.", "mode"),
		verifySeconds:      r.Histogram("mcguard_verification_seconds", "Time of a chunk's fence and verification, by verify mode.", "mode"),
		engineCallSeconds:  r.Histogram("mcguard_engine_call_seconds", "Time of each call into the application's engine (over an engine data plane): what of a transfer was the engine's own."),
	}
	r.Gauge("mcguard_sessions", "Sessions this guard sends to.", func() int64 {
		g.mu.Lock()
		defer g.mu.Unlock()
		return int64(len(g.sessions))
	})
	r.Gauge("mcguard_connections", "Peers' data connections (TCP) and queue pairs (RDMA) this guard serves.", func() int64 {
		n := 0
		for _, p := range g.planes {
			n += p.Connections()
		}
		return int64(n)
	})
	r.Gauge("mcguard_engine_calls_in_flight", "Engine calls not yet returned (over an engine data plane; held writes included): a failed transfer's blocks are reused once it is 0.", func() int64 {
		if g.engine == nil {
			return 0
		}
		return g.engine.InFlight()
	})
	return m
}

// outcomeOf names a call's outcome for the metrics: ok, or its status.
func outcomeOf(err error) string {
	if err == nil {
		return "ok"
	}
	for _, e := range []struct {
		err  error
		name string
	}{
		{errs.Closed, "closed"}, {errs.Cancelled, "cancelled"}, {errs.InvalidArg, "invalid_arg"}, {errs.Config, "config"},
		{errs.NotRegistered, "not_registered"}, {errs.Device, "device"}, {errs.Verify, "verify"}, {errs.Quiesced, "quiesced"},
		{errs.Timeout, "timeout"}, {errs.Session, "session"}, {errs.Peer, "peer"}, {errs.NoMemory, "no_memory"},
	} {
		if errors.Is(err, e.err) {
			return e.name
		}
	}
	return "internal"
}

// Metrics returns the guard's metrics in the Prometheus text format.
func (g *Guard) Metrics() ([]byte, error) {
	if err := g.enter(); err != nil {
		return nil, err
	}
	defer g.leave()
	var b strings.Builder
	err := g.metrics.reg.Write(&b)
	return []byte(b.String()), err
}
