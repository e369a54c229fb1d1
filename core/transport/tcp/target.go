package tcp

import (
	"bufio"
	"bytes"
	"crypto/hmac"
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/core/fault"
	"github.com/mcguard/mcguard/core/logs"
	"github.com/mcguard/mcguard/core/memory"
	"github.com/mcguard/mcguard/core/transport"
	"github.com/mcguard/mcguard/core/transport/samehost"
	"github.com/mcguard/mcguard/core/wire"
)

// maxTargetConns bounds the data connections a target serves at once;
// past it a stranger's (no valid hello yet) is shut for a newcomer.
const maxTargetConns = 1024

// target is the receiving half of the TCP data plane: it applies peers'
// writes into registered memory and serves their read-backs. Without
// fault injection a write is acknowledged only after its bytes are in
// place.
type target struct {
	regions *memory.Regions
	tokens  Tokens // a data connection must first present one of them
	timeout time.Duration
	// busyPoll: a busy connection's reads spin this long before parking,
	// at most spins.n of them at once.
	busyPoll time.Duration
	spins    spinSlots
	spun     *SpinCounts
	pending  *transport.Pending // writes being applied, or held by a fault: what Settle waits for
	reads    *transport.Pending // ranges being read: what Quiesce waits for too
	readHook func(phase string) // tests only: HoldReadsForTest

	// Fault injection. Held writes (lag, reorder) are applied later under
	// applyMu, which reads also take, so a read-back sees a held write
	// either not at all or whole.
	faults  *fault.Injector
	refused func(reason string) // counts refusals, if set
	notice  func(body []byte, landed transport.Landed, conn *transport.ConnAuth) error
	landed  *landedIndex // digests taken as bytes land; nil: off (or faults on)
	applyMu sync.Mutex
	closed  bool // under applyMu: held writes stop touching memory
	late    sync.WaitGroup

	q    quiescer
	stop chan struct{} // closed when the target closes: held writes give up

	grants   samehost.Grants    // same-host senders: their pids and nonces
	identity *samehost.Identity // where same-host senders prove their process; nil: same-host off
	// macReplies: the guards share a secret; the replies verification
	// rests on are tagged (replytag.go).
	macReplies bool
	pulled     atomic.Int64     // bytes copied out of same-host senders' memory
	ipcs       samehost.IPCMaps // same-host senders' GPU allocations opened here
	ipcBytes   atomic.Int64     // bytes copied out of them
	lease      *samehost.Lease  // same-host senders write host memory themselves; nil: off

	ln        net.Listener
	mu        sync.Mutex
	conns     map[net.Conn]*link
	ringTake  sync.Mutex          // takeRingNotices, one at a time
	ringed    []*link             // its scratch
	strangers []*link             // links in the order they came, until they said a valid hello (some since did, or went)
	senders   map[string]net.Conn // each sender's current data connection
	wg        sync.WaitGroup
}

func newTarget(cfg Config) (*target, error) {
	ln, err := net.Listen("tcp", net.JoinHostPort(cfg.Host, "0"))
	if err != nil {
		return nil, fmt.Errorf("%w: target cannot listen on %s: %v", errs.Config, cfg.Host, err)
	}
	return serveOn(ln, cfg), nil
}

// serveOn runs a target on ln.
func serveOn(ln net.Listener, cfg Config) *target {
	t := &target{regions: cfg.Regions, tokens: cfg.Tokens, timeout: cfg.Timeout, busyPoll: cfg.BusyPoll, spun: cfg.spins, ln: ln, conns: map[net.Conn]*link{}, senders: map[string]net.Conn{},
		pending: transport.NewPending(), reads: transport.NewPending(), stop: make(chan struct{}), refused: cfg.Refused, macReplies: cfg.MACReplies, notice: cfg.Notice, faults: fault.New(cfg.Faults, cfg.TailBytes, ln.Addr().String())}
	if cfg.DigestAtLanding && t.faults == nil { // under fault injection syncs re-read: faults change bytes after they land
		t.landed = &landedIndex{}
	}
	// Senders write themselves only where nothing needs the target to
	// apply each write: no digests as bytes land, and no fault that holds
	// writes back (the faults that act on one write at once, senders
	// inject themselves: pushFaults).
	if cfg.SameHost != samehost.Off {
		var err error
		if t.identity, err = samehost.NewIdentity(&t.grants, cfg.Timeout); err != nil {
			logs.Printf(logs.Info, "same-host transfers not offered: no identity socket: %v", err)
		}
	}
	if t.identity != nil && cfg.SameHostWriter != samehost.WriterReceiver && pushFaults(t.faults) && t.landed == nil {
		var err error
		if t.lease, err = samehost.NewLease(cfg.Timeout); err != nil {
			logs.Printf(logs.Info, "same-host writes by the sender not offered: no lease file: %v", err)
		}
	}
	t.wg.Add(1)
	go t.accept()
	return t
}

func (t *target) addr() string { return t.ln.Addr().String() }

// accept serves data connections until the listener is closed.
func (t *target) accept() {
	defer t.wg.Done()
	transport.AcceptEach(t.ln, "target "+t.addr(), func(c net.Conn) bool {
		t.mu.Lock()
		defer t.mu.Unlock()
		if t.conns == nil {
			c.Close() // closing
			return false
		}
		if len(t.conns) >= maxTargetConns && !t.shutOldestStrangerLocked() {
			c.Close() // every one is a sender's: refuse the newcomer, keep serving them
			return true
		}
		l := &link{c: c}
		l.ring.slot.Store(-1)
		t.conns[c] = l
		t.keepStrangerLocked(l)
		t.wg.Add(1)
		go t.serve(l)
		return true
	})
}

// shutOldestStrangerLocked shuts the oldest connection that has not said
// a valid hello, for a newcomer at maxTargetConns: a flood of sockets that
// never say one cannot keep an honest sender out, and cannot touch a
// bound sender's connection. false where there is none.
func (t *target) shutOldestStrangerLocked() bool {
	for len(t.strangers) > 0 {
		l := t.strangers[0]
		t.strangers = t.strangers[1:]
		if l.greeted.Load() || t.conns[l.c] != l {
			continue // said its hello, or gone
		}
		l.c.Close() // its serve loop ends and lets go of it
		return true
	}
	return false
}

// keepStrangerLocked queues a new link for shutOldestStrangerLocked,
// dropping the queue's links that said their hello or are gone once they
// outnumber the live ones.
func (t *target) keepStrangerLocked(l *link) {
	t.strangers = append(t.strangers, l)
	if len(t.strangers) > 2*len(t.conns)+64 {
		live := t.strangers[:0]
		for _, s := range t.strangers {
			if !s.greeted.Load() && t.conns[s.c] == s {
				live = append(live, s)
			}
		}
		clear(t.strangers[len(live):])
		t.strangers = live
	}
}

// refusalNames name the statuses a target refuses with, for metrics.
var refusalNames = map[wire.Status]string{
	wire.StatusNotRegistered: "not_registered", wire.StatusBadRequest: "bad_request", wire.StatusUnauthorized: "unauthorized",
	wire.StatusTooLarge: "too_large", wire.StatusDevice: "device", wire.StatusQuiesced: "quiesced",
}

func (t *target) close() {
	close(t.stop)
	t.ln.Close()
	t.mu.Lock()
	for c := range t.conns {
		c.Close()
	}
	t.conns = nil
	t.mu.Unlock()
	t.wg.Wait()
	t.applyMu.Lock()
	t.closed = true
	t.applyMu.Unlock()
	t.late.Wait()
	if gpu := t.regions.GPU(); gpu != nil {
		t.ipcs.Drop(gpu, 0)
	}
	if t.lease != nil {
		t.lease.Close()
	}
	if t.identity != nil {
		t.identity.Close()
	}
}

// hello checks a Hello: a token the guard issued, and the proof of its
// key over this connection's challenge. The link keeps the handshake, for
// the notices that come on it.
func (t *target) hello(l *link, r io.Reader, n uint64, challenge []byte) (wire.Status, string) {
	if n != wire.HelloSize {
		io.CopyN(io.Discard, r, int64(n))
		return wire.StatusUnauthorized, ""
	}
	got := make([]byte, n)
	if _, err := io.ReadFull(r, got); err != nil {
		return wire.StatusUnauthorized, ""
	}
	sender, key, ok := t.tokens(got[:wire.TokenSize])
	if !ok || !hmac.Equal(got[wire.TokenSize:], transport.ConnectionProof(key, challenge)) {
		return wire.StatusUnauthorized, ""
	}
	if t.macReplies && l.mac == nil {
		l.mac = newReplyMAC(key, challenge)
	}
	if tok := got[:wire.TokenSize:wire.TokenSize]; !bytes.Equal(tok, l.auth.Token) {
		l.ring.mu.Lock()                                                  // a sync may be checking the ring's notices under it
		t.ringNotices(l)                                                  // under the handshake they were sent under
		l.auth = transport.ConnAuth{Token: tok, Key: key, Sender: sender} // a hello again under the same handshake keeps its sequence
		l.ring.mu.Unlock()
	}
	return wire.StatusOK, sender
}

// reply writes one reply and, with flush (nothing more pipelined behind
// it: coalesce a batch's replies), sends what is buffered. It holds the
// link's write lock, so a pushed mark never lands inside a reply.
func (t *target) reply(l *link, w *bufio.Writer, hdr []byte, rep wire.Header, payload func(io.Writer) error, flush bool) error {
	l.wmu.Lock()
	defer l.wmu.Unlock()
	rep.Encode(hdr)
	if _, err := w.Write(hdr); err != nil {
		return err
	}
	mac := l.mac
	if mac != nil && !tagged(rep.Op&^wire.Reply) {
		mac = nil
	}
	if mac != nil {
		mac.begin(hdr)
	}
	if payload != nil {
		var to io.Writer = w
		if mac != nil {
			l.tee = teeWriter{w, mac}
			to = &l.tee
		}
		if err := payload(to); err != nil {
			return err
		}
	}
	if mac != nil {
		if _, err := w.Write(mac.tag()); err != nil {
			return err
		}
	}
	if flush || rep.Status == wire.StatusUnauthorized {
		return w.Flush()
	}
	return nil
}

// claim makes l the sender's data connection of its stripe and drops the
// one before it: a sender reconnects after giving up on the old one, whose
// late bytes must not land on top of newer writes.
func (t *target) claim(sender string, stripe int, l *link) {
	if sender == "" {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	l.sender = sender
	key := fmt.Sprintf("%s/%d", sender, stripe)
	if old, ok := t.senders[key]; ok && old != l.c {
		old.Close()
	}
	t.senders[key] = l.c
}
