package tcp

import (
	"context"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/mcguard/mcguard/core/memory"
	"github.com/mcguard/mcguard/core/transport"
	"github.com/mcguard/mcguard/core/wire"
)

// Quiescing on TCP. The target knows what it applies, so it can refuse a
// write that was sent before the receiver quiesced its destination and
// arrives afterwards (queued on a connection, or held up on a slow or
// partitioned path), while taking the writes sent after:
//   - each quiesce raises the target's generation and records its ranges;
//   - every data connection (link) has the generation its sender has
//     caught up with: the one it learned in its handshake, and then each
//     one the target pushes to it (an OpMark frame) and the sender echoes
//     back in its stream, before its next writes;
//   - a write that reaches a range quiesced at a generation its link has
//     not caught up with is refused (StatusQuiesced), its payload dropped.
// A write in progress into a quiesced range when the quiesce comes is
// waited for; nothing else stops.

// maxQuiesceRecords bounds the ranges kept; past it the oldest go, and a
// link behind them is refused everywhere until it catches up.
const maxQuiesceRecords = 4096

// link is one data connection's state that other goroutines touch.
type link struct {
	c       net.Conn
	sender  string
	wmu     sync.Mutex    // orders the serve loop's replies and pushed marks on c
	ack     atomic.Uint64 // the generation its sender has caught up with
	aborted atomic.Bool   // its sender gave up on it: nothing it brought may land
	bound   atomic.Bool   // its hello was taken: it may be sent marks
	// greeted: its hello was found valid, set before the hello's answer
	// goes (bound only after it): a stranger no more, never shut for a
	// newcomer once its sender may be writing.
	greeted atomic.Bool
	applyMu sync.Mutex         // held while one of its writes is applied
	pid     int                // a same-host sender that proved it is this pid (serve loop only)
	stream  streamSource       // the write frame being applied (serve loop only)
	rd      readReply          // the read frame being answered (serve loop only)
	land    landing            // digests taken as its marked writes land (serve loop only)
	notice  []byte             // its notices' bodies, one at a time (noticeBody; serve loop only)
	auth    transport.ConnAuth // the handshake its hello proved (written by the serve loop under ring.mu)
	ring    noticeRing         // its lease slot (samehost.Lease) and that slot's notice ring
	mac     *replyMAC          // tags its replies where the guards share a secret (serve loop only)
	tee     teeWriter          // a reply's payload into the connection and its tag (serve loop only)
}

type quiesceRecord struct {
	memory.Region
	gen uint64
}

// quiescer holds the generation and the quiesced ranges.
type quiescer struct {
	gen     atomic.Uint64
	mu      sync.Mutex
	records []quiesceRecord
	floor   uint64 // links behind it are refused wherever they write
}

// refuses reports whether a write into r from a link caught up with ack
// must be refused.
func (q *quiescer) refuses(ack uint64, r memory.Region) bool {
	if ack >= q.gen.Load() {
		return false // the common case: nothing quiesced since
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	if ack < q.floor {
		return true
	}
	for _, rec := range q.records {
		if rec.gen > ack && rec.Overlaps(r) {
			return true
		}
	}
	return false
}

// add records ranges under a new generation and returns it.
func (q *quiescer) add(ranges []memory.Region) uint64 {
	q.mu.Lock()
	defer q.mu.Unlock()
	g := q.gen.Load() + 1
	for _, r := range ranges {
		q.records = append(q.records, quiesceRecord{r, g})
	}
	if over := len(q.records) - maxQuiesceRecords; over > 0 {
		q.floor = q.records[over-1].gen
		q.records = append(q.records[:0], q.records[over:]...)
	}
	q.gen.Store(g)
	return g
}

// catchUp records that the link's sender has seen generation g (at most
// the current one: a sender cannot skip ahead).
func (l *link) catchUp(g, current uint64) {
	g = min(g, current)
	for {
		old := l.ack.Load()
		if g <= old || l.ack.CompareAndSwap(old, g) {
			return
		}
	}
}

// lower sets the link's generation down to g: its sender carries on a
// transfer that began under g on this new connection.
func (l *link) lower(g uint64) {
	for {
		old := l.ack.Load()
		if g >= old || l.ack.CompareAndSwap(old, g) {
			return
		}
	}
}

// quiesce refuses from now on every write into ranges from a link that
// has not caught up with this quiesce, and from a same-host sender's
// transfer that began before it (the lease's quiesce word: its writes go
// through the socket from then on, where this check meets them), waits
// for same-host writes in progress, pushes the new generation to every
// link, and waits for the writes into ranges being applied.
func (t *target) quiesce(ctx context.Context, ranges []memory.Region) error {
	g := t.q.add(ranges)
	if t.lease != nil {
		t.lease.Quiesced(g)
	}
	if err := t.settleWriters(ctx); err != nil {
		return err
	}
	t.mu.Lock()
	links := make([]*link, 0, len(t.conns))
	for _, l := range t.conns {
		if l.bound.Load() { // a link bound later catches up at its hello (bindLink)
			links = append(links, l)
		}
	}
	t.mu.Unlock()
	mark := markFrame(g)
	// Pushed before quiesce returns, so that a sender told of the reuse
	// afterwards finds the mark waiting (a sender that starts a transfer
	// before the mark reaches it is refused, its transfer failing with
	// MC_ERR_QUIESCED: it raced the quiesce).
	var pushed sync.WaitGroup
	for _, l := range links {
		pushed.Go(func() { t.push(l, mark) })
	}
	pushed.Wait()
	if err := t.reads.Wait(ctx, ranges); err != nil {
		return err
	}
	return t.pending.Wait(ctx, ranges)
}

func markFrame(g uint64) []byte {
	mark := make([]byte, wire.HeaderSize)
	wire.Header{Op: wire.OpMark, Addr: g}.Encode(mark)
	return mark
}

// bindLink takes a link's hello: it has caught up with the generation of
// its sender's handshake, and where a quiesce came since, it is sent a
// mark at once (a quiesce skips links not yet bound). Bound is set before
// the generation is read, and a quiesce raises the generation before it
// reads bound: one of the two pushes the mark.
func (t *target) bindLink(l *link, handshakeGen uint64) {
	l.catchUp(handshakeGen, t.q.gen.Load())
	l.bound.Store(true)
	if g := t.q.gen.Load(); l.ack.Load() < g {
		t.push(l, markFrame(g))
	}
}

// push writes a mark to a link; a link that cannot take it in time is
// closed (what it still had queued is dropped with it).
func (t *target) push(l *link, mark []byte) {
	l.wmu.Lock()
	defer l.wmu.Unlock()
	l.c.SetWriteDeadline(time.Now().Add(t.timeout))
	if _, err := l.c.Write(mark); err != nil {
		l.c.Close()
	}
}

// abort makes sure nothing the sender's links brought lands any more: they
// are marked aborted and closed, and a write of theirs being applied is
// waited for.
func (t *target) abort(sender string) {
	t.mu.Lock()
	var links []*link
	for _, l := range t.conns {
		if l.sender == sender {
			links = append(links, l)
		}
	}
	t.mu.Unlock()
	for _, l := range links {
		l.aborted.Store(true)
		l.c.Close()
		l.applyMu.Lock() // a write already being applied finishes first
		l.applyMu.Unlock()
	}
}
