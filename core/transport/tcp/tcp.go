// Package tcp is the embedded data plane: a target server that applies
// peers' writes into registered memory and acknowledges each after
// applying it (target.go), and the sender's pipelined connection to such a
// target (conn.go). Frames are core/wire's.
package tcp

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"sync/atomic"
	"time"

	"github.com/mcguard/mcguard/core/cuda"
	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/core/fault"
	"github.com/mcguard/mcguard/core/memory"
	"github.com/mcguard/mcguard/core/transport"
	"github.com/mcguard/mcguard/core/transport/samehost"
)

// Name is the data plane's name in handshakes.
const Name = "tcp"

// Tokens says whom a data connection's token was issued to, and the key
// its hello must prove, if anyone.
type Tokens func(token []byte) (sender string, key []byte, ok bool)

// Config is what the TCP data plane needs of its guard.
type Config struct {
	Host      string          // the interface the target listens on (a free port is picked)
	Timeout   time.Duration   // bounds every wait on a peer
	Regions   *memory.Regions // the guard's registered memory
	Tokens    Tokens
	Faults    fault.Config // target-side fault injection (off: fault.None)
	TailBytes int          // the tail check's length, for the stale fault
	// Refused, if set, counts the peer writes the target refuses, by reason.
	Refused func(reason string)
	// Notice, if set, takes a completion notice that came on a data
	// connection (the guard checks it as one from the control channel),
	// with the digests taken as its descriptors landed (nil: none).
	Notice func(body []byte, landed transport.Landed, conn *transport.ConnAuth) error
	// DigestAtLanding: digest marked writes as they land (landed.go).
	DigestAtLanding bool
	Settings                    // stripes and busy polling
	spins           *SpinCounts // set by New
	// SameHost is samehost.Auto, samehost.Off or samehost.Required: as a
	// sender whether to offer same-host transfers, as a target whether
	// to grant them.
	SameHost string
	// SameHostWriter is, for a target, who copies same-host senders'
	// host-memory writes: samehost.WriterSender (they write into this
	// process themselves, push.go) or samehost.WriterReceiver (the target
	// reads them out of the sender).
	SameHostWriter string
	// MACReplies: the guards share a secret, so the replies a sender's
	// verification rests on are authenticated (replytag.go).
	MACReplies bool
	// Pushed, if set, counts the bytes this guard's connections wrote
	// into same-host targets themselves.
	Pushed *atomic.Int64
	// Joined, if set, counts the descriptors that went inside another
	// descriptor's write (consecutive ones joined, transport.Cursor).
	Joined *atomic.Int64
	// Mapped, if set, counts those of them copied with memcpy into a
	// target's shared allocation mapped here.
	Mapped *atomic.Int64
}

// Transport is the TCP data plane of one guard.
type Transport struct {
	cfg       Config
	target    *target
	fallbacks samehost.Fallbacks // same-host connections that sent their bytes through the socket (auto)
	ringed    atomic.Int64       // notices its connections put in a receiver's notice ring
}

// SameHostFallbacks is how many of this guard's connections to a receiver
// on this host sent their bytes through the socket under same_host
// "auto", and why the last one did.
func (t *Transport) SameHostFallbacks() (int64, string) { return t.fallbacks.Last() }

// BusyPolls is what busy polling cost and won: spins, those that paid,
// and the time spent spinning.
func (t *Transport) BusyPolls() (spins, paid int64, spent time.Duration) {
	c := t.cfg.spins
	return c.spins.Load(), c.paid.Load(), time.Duration(c.nanos.Load())
}

// New starts the target server.
func New(cfg Config) (*Transport, error) {
	cfg.spins = &SpinCounts{} // this transport's senders and target count together
	t, err := newTarget(cfg)
	if err != nil {
		return nil, err
	}
	return &Transport{cfg: cfg, target: t}, nil
}

// handshakeAnswer is the target's part of a handshake reply (the replies
// to frames are answer.go's).
type handshakeAnswer struct {
	Data string `json:"data"` // the target's "host:port"
	// FinalFence: the target answers a fence after every earlier write of
	// the connection is applied (not so under reorder injection, whose
	// writes stand for another path a fence does not flush).
	FinalFence bool `json:"final_fence,omitempty"`
	// Landing: the target digests marked writes as they land (landed.go);
	// where it does not, a sender sends digest mode's writes unmarked, so
	// that consecutive descriptors join.
	Landing bool `json:"landing,omitempty"`
	// HostOnly: the target has no CUDA driver, so every region it
	// registers is host memory, where a joined write may span separate
	// allocations (one device copy could not: joinReach).
	HostOnly bool `json:"host_only,omitempty"`
	// AcksFinal: the target answers each write once it is in place and
	// holds none back (no fault injection), so the answers to a
	// connection's writes say all its fence would.
	AcksFinal bool `json:"acks_final,omitempty"`
	// Gen is the target's quiesce generation: the sender's writes are
	// taken where nothing was quiesced since.
	Gen uint64 `json:"gen,omitempty"`
	// SameHost is the nonce a same-host sender proves its connections
	// with; SameHostWhy says why there is none for an offer.
	SameHost    string `json:"same_host,omitempty"`
	SameHostWhy string `json:"same_host_why,omitempty"`
	// Identity is the target's identity socket (identity.go), on which
	// the sender proves its process with the nonce before any connection
	// of it may prove itself.
	Identity string `json:"identity,omitempty"`
	// Pid is the target's process, which the sender lets read its memory
	// (Yama) and which cannot open its own CUDA IPC handles. CudaIPC: the
	// target opens CUDA IPC handles of same-host senders' GPU memory.
	CudaIPC bool `json:"cuda_ipc,omitempty"`
	Pid     int  `json:"pid,omitempty"`
	// LeaseFD is the target's lease file (samehost.Lease) in process Pid, and
	// LeaseNonce what its first bytes say: a proved connection's sender
	// writes into the target's host memory itself.
	LeaseFD    int    `json:"lease_fd,omitempty"`
	LeaseNonce string `json:"lease_nonce,omitempty"`
	// Faults is the target's fault injection, for a sender that writes
	// into it itself to inject on its behalf (push.go); TailBytes the
	// tail check's length (stale).
	Faults    *fault.Config `json:"faults,omitempty"`
	TailBytes int           `json:"tail_bytes,omitempty"`
}

func (*Transport) Name() string { return Name }

// Describe names the target's address.
func (t *Transport) Describe() string { return "tcp target on " + t.target.addr() }

// Addr is the target server's "host:port".
func (t *Transport) Addr() string { return t.target.addr() }

// Register puts host memory in the lease table, for same-host senders
// to write into themselves (by memcpy where it is a shared allocation);
// the target checks its own writes against the guard's table.
func (t *Transport) Register(addr, n uint64, mem cuda.Memory) error {
	if l := t.target.lease; l != nil && !mem.Device {
		shared, _ := samehost.LookupShared(addr, n, t.cfg.Regions)
		l.Add(addr, n, shared)
	}
	return nil
}

// Unregister forgets every digest taken as bytes landed, and waits until
// no same-host sender can still be writing into the region: the memory
// may be reused.
func (t *Transport) Unregister(addr uint64) error {
	if t.target.landed != nil {
		t.target.landed.forgetAll()
	}
	if l := t.target.lease; l != nil {
		return l.Remove(addr)
	}
	return nil
}

// Accept answers a handshake with the target's address and, for a
// sender's same-host offer, a nonce to prove or why not.
func (t *Transport) Accept(peer transport.Peer, offer []byte, _ []memory.Region) ([]byte, error) {
	a := handshakeAnswer{Data: t.target.addr(), FinalFence: t.target.faults.Mode() != fault.Reorder, Gen: t.target.q.gen.Load(),
		Landing: t.target.landed != nil, HostOnly: t.cfg.Regions.GPU() == nil, AcksFinal: t.target.faults == nil}
	if len(offer) != 0 {
		var nonce []byte
		nonce, a.SameHostWhy = t.target.grants.Answer(t.cfg.SameHost, t.target.identity != nil, peer.Sender, offer)
		if nonce != nil {
			a.SameHost = hex.EncodeToString(nonce)
			a.Identity = t.target.identity.Name()
			a.Pid = os.Getpid() // the sender lets it read its memory (Yama)
			gr, _ := t.target.grants.Get(peer.Sender)
			a.CudaIPC = t.cfg.Regions.GPU() != nil && !gr.NoIPC
			if l := t.target.lease; l != nil {
				a.LeaseFD, a.LeaseNonce = l.FD(), hex.EncodeToString(l.Nonce())
				if t.target.faults != nil {
					a.Faults, a.TailBytes = &t.cfg.Faults, t.cfg.TailBytes
				}
			}
		}
	}
	return json.Marshal(a)
}

// PulledBytes counts the bytes the target copied out of same-host
// senders' memory.
func (t *Transport) PulledBytes() int64 { return t.target.pulled.Load() }

// SameHostWriters counts the same-host senders' connections that hold a
// lease slot here (at most samehost.MaxLeaseSlots); -1 where none is offered.
func (t *Transport) SameHostWriters() int {
	if t.target.lease == nil {
		return -1
	}
	return t.target.lease.Writers()
}

// IPCBytes counts the bytes the target copied out of same-host senders'
// GPU memory by CUDA IPC.
func (t *Transport) IPCBytes() int64 { return t.target.ipcBytes.Load() }

// Settle waits for the writes into ranges that the target is applying, or
// that fault injection holds back. A write is acknowledged only after it
// is applied, so outside fault injection this waits at most for a write
// still arriving.
func (t *Transport) Settle(ctx context.Context, ranges []memory.Region) error {
	if err := t.target.settleWriters(ctx); err != nil {
		return err
	}
	return t.target.pending.Wait(ctx, ranges)
}

// Quiesce refuses from now on every write into ranges sent before this
// call, wherever it is queued, and waits for those being applied, by the
// target or by same-host senders writing themselves (those that begin
// after it are writes sent after the call).
func (t *Transport) Quiesce(ctx context.Context, ranges []memory.Region) error {
	return t.target.quiesce(ctx, ranges)
}

// Abort makes sure nothing more from the sender's data connections lands:
// they are closed, their same-host writes revoked, and a write of theirs
// in progress is waited for.
func (t *Transport) Abort(peer transport.Peer) error {
	t.target.abort(peer.Sender)
	if l := t.target.lease; l != nil {
		ctx, cancel := context.WithTimeout(context.Background(), t.cfg.Timeout)
		defer cancel()
		return l.Revoke(ctx, peer.Sender)
	}
	return nil
}

// Stats adds the same-host copies, the same-host fallbacks and the busy
// polls to a guard's stats.
func (t *Transport) Stats(out map[string]any) {
	out["same_host_pulled_bytes"] = t.PulledBytes()
	out["same_host_ipc_bytes"] = t.IPCBytes()
	out["same_host_writers"] = t.SameHostWriters()
	out["same_host_fallbacks"], out["same_host_fallback_why"] = t.SameHostFallbacks()
	out["same_host_ringed_notices"] = t.ringed.Load()
	spins, paid, spent := t.BusyPolls()
	out["busy_poll_spins"], out["busy_poll_paid"], out["busy_poll_spent_us"] = spins, paid, spent.Microseconds()
}

// TakeRingNotices takes the completion notices same-host senders put in
// their connections' notice rings (a sync looks for its notice); false
// where this target offers no rings.
func (t *Transport) TakeRingNotices() bool { return t.target.takeRingNotices() }

// Connections counts the data connections the target serves.
func (t *Transport) Connections() int {
	t.target.mu.Lock()
	defer t.target.mu.Unlock()
	return len(t.target.conns)
}

// Close stops the target; held writes are dropped.
func (t *Transport) Close() { t.target.close() }

// Dial returns a dialer; it offers where it runs (same-host transfers).
func (t *Transport) Dial() (transport.Dialer, error) { return dialer{t}, nil }

type dialer struct{ t *Transport }

func (d dialer) Offer() []byte { return samehost.OfferFor(d.t.cfg.SameHost) }
func (dialer) Abandon()        {}

// Connect opens a data connection to the answer's address and presents
// the handshake's token.
func (d dialer) Connect(ctx context.Context, peer transport.Peer, raw []byte, regions []memory.Region) (transport.Conn, error) {
	var a handshakeAnswer
	if err := json.Unmarshal(raw, &a); err != nil || a.Data == "" {
		return nil, fmt.Errorf("%w: the target's tcp answer %q has no data address", errs.Session, raw)
	}
	addr := a.Data
	// A target listening on every interface ("0.0.0.0", "[::]") is
	// reached where its guard's control endpoint was.
	if host, port, err := net.SplitHostPort(addr); err == nil && peer.Host != "" {
		if ip := net.ParseIP(host); ip != nil && ip.IsUnspecified() {
			addr = net.JoinHostPort(peer.Host, port)
		}
	}
	table := newPeerTable(regions)
	open := func(ctx context.Context, stripe int) (*conn, error) {
		c, err := dial(ctx, addr, peer, table, a.Gen, &d.t.cfg, stripe)
		if err != nil {
			return nil, err
		}
		c.finalFence, c.landing, c.hostOnly, c.acksFinal = a.FinalFence, a.Landing, a.HostOnly, a.AcksFinal
		c.pushed, c.mapped, c.joined, c.fallbacks, c.ringed = d.t.cfg.Pushed, d.t.cfg.Mapped, d.t.cfg.Joined, &d.t.fallbacks, &d.t.ringed
		if err = c.sameHost(ctx, d.t.cfg.SameHost, a); err != nil {
			c.Close()
			return nil, err
		}
		if c.lease != nil && a.Faults != nil {
			// Each connection its own stream of fates: a failed transfer
			// drops its connection, and a new one that replayed the seed's
			// stream would fail the same transfer of every connection
			// (every second one, at a 1 % drop rate over 32 writes).
			f := *a.Faults
			f.Seed += int(pushFaultConns.Add(1))
			c.faults = fault.New(f, a.TailBytes, "same-host writes into "+addr)
		}
		return c, nil
	}
	first, err := open(ctx, 0)
	if err != nil {
		return nil, err
	}
	n := min(max(d.t.cfg.Stripes, 1), MaxStripes)
	if n == 1 || first.lease != nil {
		return first, nil // one connection, or one that writes into the receiver itself: no striping layer
	}
	return newStriped(first, n, open), nil
}

var (
	_ transport.Transport     = (*Transport)(nil)
	_ transport.Conn          = (*conn)(nil)
	_ transport.TransferBound = (*conn)(nil)
	_ transport.TransferBound = (*striped)(nil)
)

// pushFaultConns numbers the connections that inject a target's faults
// themselves (push.go), for their seeds.
var pushFaultConns atomic.Int64
