package core

import (
	"crypto/hmac"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/mcguard/mcguard/core/auth"
	"github.com/mcguard/mcguard/core/control"
	"github.com/mcguard/mcguard/core/desc"
	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/core/memory"
	"github.com/mcguard/mcguard/core/notices"
	"github.com/mcguard/mcguard/core/reuse"
	"github.com/mcguard/mcguard/core/transport"
	"github.com/mcguard/mcguard/core/wire"
	"github.com/mcguard/mcguard/verify"
)

// The receiver: completion notices as they arrive, and the application's
// sync calls that settle the ranges they name and compare digests.

// receiveNotice records a peer's notice; the reply says whether it was
// taken. A notice that is malformed or names memory this guard did not
// register is refused whole.
func (g *Guard) receiveNotice(body []byte) []byte {
	rep := control.Reply{Proto: control.ProtocolVersion}
	if err := g.takeNotice(body, nil, nil); err != nil {
		rep.Error = err.Error()
		if errors.Is(err, auth.ErrUnknownNoticeToken) {
			rep.Code = control.CodeUnknownToken
		}
	}
	out, _ := json.Marshal(rep)
	return out
}

// takeNotice records a notice, from the control channel or a data
// connection (conn: the handshake it proved): it must decode, prove its
// handshake (token, sequence, MAC) and name only memory registered here.
func (g *Guard) takeNotice(body []byte, landed transport.Landed, conn *transport.ConnAuth) error {
	buf := noticeDescBufs.Get().(*[]wire.NoticeDesc)
	defer noticeDescBufs.Put(buf)
	n, err := wire.DecodeNotice(body, len(verify.Modes), *buf)
	*buf = reuse.Keep(n.Descs) // its room, for the next notice
	var sender string
	if err == nil {
		sender, err = g.proveNotice(n, body, conn)
	}
	if err == nil {
		for i, d := range n.Descs {
			if g.regions.Check(d.Dst, d.Len) != nil {
				err = fmt.Errorf("notice descriptor %d names [%#x, +%d), which is not registered here", n.Base+i, d.Dst, d.Len)
				break
			}
		}
	}
	if err == nil {
		err = g.notices.Add(n, landed, sender)
	}
	if err == nil {
		g.stats.noticesReceived.Add(1)
		g.metrics.noticesReceived.Add(1)
	}
	return err
}

// proveNotice checks a notice's handshake: in the guard's table; or, for
// a notice on a data connection under the handshake that connection
// proved, the connection's, which outlives the table's entry. So a
// session crowded out of the table (or idle past tokenIdle) goes on over
// its connection, and a same-host sender, which does not wait for its
// notice's answer, never has one refused as stale.
func (g *Guard) proveNotice(n wire.Notice, body []byte, conn *transport.ConnAuth) (sender string, err error) {
	macOK := func(key []byte) bool { m := auth.NoticeMAC(key, body); return hmac.Equal(n.MAC, m[:]) }
	sender, err = g.auth.Tokens.Notice(n.Token, n.Seq, macOK)
	onConn := conn != nil && len(conn.Token) > 0 && hmac.Equal(n.Token, conn.Token)
	switch {
	case err == nil:
		if onConn {
			conn.LastSeq = max(conn.LastSeq, n.Seq)
		}
		return sender, nil
	case !onConn || !errors.Is(err, auth.ErrUnknownNoticeToken):
		return "", err
	case !macOK(conn.Key):
		return "", fmt.Errorf("the MAC is wrong: not from the sender that shook hands")
	case n.Seq <= conn.LastSeq:
		return "", fmt.Errorf("the sequence number %d is not above %d: a replay", n.Seq, conn.LastSeq)
	}
	conn.LastSeq = n.Seq
	return conn.Sender, nil
}

// noticeDescBufs are decode buffers: the store copies a notice's
// descriptors, so decoding need not allocate.
var noticeDescBufs = sync.Pool{New: func() any { return new([]wire.NoticeDesc) }}

// SyncRange is one destination range the receiver was told is complete.
type SyncRange struct{ Addr, Len uint64 }

// Sync is the receiver's half for ranges the application was told about
// (the vLLM connector's own OK message): it waits until writes still in
// flight to them have landed, makes them safe to read (the device hook: a
// full fence for host memory) and, when digests are given (one per range,
// as the sender's mc_guard_transfer returned them), compares them.
func (g *Guard) Sync(ranges []SyncRange, digests []uint64, stream uint64) (err error) {
	if err := g.enter(); err != nil {
		return err
	}
	defer g.leave()
	defer g.timeSync(time.Now())
	defer func() { g.metrics.syncs.Add(1, outcomeOf(err)) }()
	if len(ranges) > MaxDescriptors {
		return fmt.Errorf("%w: %d ranges, limit %d per call", errs.InvalidArg, len(ranges), MaxDescriptors)
	}
	if digests != nil && len(digests) != len(ranges) {
		return fmt.Errorf("%w: %d digests for %d ranges", errs.InvalidArg, len(digests), len(ranges))
	}
	for i, r := range ranges {
		if err := g.regions.Check(r.Addr, r.Len); err != nil {
			return fmt.Errorf("sync range %d: %w", i, err)
		}
	}
	c := g.beginSync()
	defer endSync(c)
	return c.settle(ranges, digests, nil, func() string { return "range" }, stream)
}

// SyncTransfers is the receiver's half for transfers announced by
// completion notices: it waits (up to sync_timeout) for each transfer's
// notice, then settles its ranges as Sync does, comparing digests when the
// transfer was sent in digest mode.
func (g *Guard) SyncTransfers(ids []uint64, stream uint64) (err error) {
	if err := g.enter(); err != nil {
		return err
	}
	defer g.leave()
	defer g.timeSync(time.Now())
	defer func() { g.metrics.syncs.Add(1, outcomeOf(err)) }()
	if len(ids) == 0 || len(ids) > MaxDescriptors {
		return fmt.Errorf("%w: %d transfer ids (1 to %d)", errs.InvalidArg, len(ids), MaxDescriptors)
	}
	c := g.beginSync()
	defer endSync(c)
	for _, id := range ids {
		n, err := g.notices.Take(id, &c.waiter, c.ctx.deadline, g.ctx.Done(), g.takeRingNotices)
		if err != nil {
			g.stats.syncFailures.Add(1)
			return err
		}
		err = c.settleNotice(n, id, stream)
		g.notices.Release(n)
		if err != nil {
			return err
		}
	}
	return nil
}

// syncCall is one sync's scratch, pooled so that a steady stream of
// syncs allocates nothing: its deadline, and the buffers the ranges are
// converted into for the planes and the digest comparison.
type syncCall struct {
	g       *Guard
	ctx     deadlineContext // sync_timeout from the call's start
	waiter  notices.Waiter  // for notices still on their way
	ranges  []SyncRange
	regions []memory.Region
	vr      []desc.Range
	digests []uint64
	landed  []transport.Landed               // the notice's digests taken as the bytes landed
	set, at int                              // where in landed the next range is looked for first
	known   func(desc.Range) (uint64, bool)  // c.landedDigest, bound once
	digest  func(desc.Range) (uint64, error) // c.readDigest, bound once: CompareDigests may hand it to goroutines
}

var syncCalls = sync.Pool{New: func() any {
	c := &syncCall{waiter: notices.NewWaiter()}
	c.known, c.digest = c.landedDigest, c.readDigest
	return c
}}

func (g *Guard) beginSync() *syncCall {
	c := syncCalls.Get().(*syncCall)
	c.g = g
	c.ctx.start(g.ctx, g.cfg.SyncTimeout)
	return c
}

// endSync stops the call's deadline and pools its scratch, less any
// buffer a huge sync grew.
func endSync(c *syncCall) {
	c.ctx.stop()
	c.g, c.landed = nil, nil
	c.ranges, c.regions, c.vr, c.digests = reuse.Keep(c.ranges), reuse.Keep(c.regions), reuse.Keep(c.vr), reuse.Keep(c.digests)
	syncCalls.Put(c)
}

// settleNotice settles the ranges notice n names.
func (c *syncCall) settleNotice(n *notices.Notice, id uint64, stream uint64) error {
	// Grown once to size: appending would regrow them step by step on
	// every sync too large for the pool to keep them (keep).
	c.ranges = slices.Grow(c.ranges[:0], len(n.Descs))
	c.digests = slices.Grow(c.digests[:0], len(n.Descs))
	for _, d := range n.Descs {
		c.ranges = append(c.ranges, SyncRange{Addr: d.Dst, Len: d.Len})
		c.digests = append(c.digests, d.Digest)
	}
	digests := c.digests
	if n.Mode != verify.Digest {
		digests = nil
	}
	return c.settle(c.ranges, digests, n.Landed, func() string { return fmt.Sprintf("transfer %#x descriptor", id) }, stream)
}

// settle waits for writes in flight to ranges, runs the device hook (for
// each GPU the ranges are on: flush GPUDirect writes, then synchronise the
// caller's stream or the context), and compares digests if there are any:
// where the target digested some ranges as they landed (digest_at
// "landing"), those digests are compared instead of reading the memory
// again.
func (c *syncCall) settle(ranges []SyncRange, digests []uint64, landed []transport.Landed, what func() string, stream uint64) error {
	g := c.g
	g.stats.syncs.Add(1)
	c.regions = slices.Grow(c.regions[:0], len(ranges))
	for _, r := range ranges {
		c.regions = append(c.regions, memory.Region(r))
	}
	defer func() {
		for _, l := range landed {
			l.Release()
		}
	}()
	for _, p := range g.planes {
		if err := p.Settle(&c.ctx, c.regions); err != nil {
			g.stats.syncFailures.Add(1)
			return fmt.Errorf("%w: %s writes to the synced ranges were still in flight after %v", errs.Timeout, p.Name(), g.cfg.SyncTimeout)
		}
	}
	// Host memory needs no hook: the target applied its writes before it
	// acknowledged them, and the application learned of the transfer
	// through a message (a syscall), which orders memory. GPU memory does:
	devices := g.regions.Devices(c.regions)
	for _, ordinal := range devices {
		if err := g.regions.GPU().Settle(ordinal, stream); err != nil {
			g.stats.syncFailures.Add(1)
			return fmt.Errorf("%w: GPU %d: %v", errs.Device, ordinal, err)
		}
	}
	if digests == nil {
		return nil
	}
	c.vr = slices.Grow(c.vr[:0], len(ranges))
	for _, r := range ranges {
		c.vr = append(c.vr, desc.Range(r))
	}
	c.landed, c.set, c.at = landed, 0, 0
	known := c.known
	if len(devices) > 0 && len(ranges) > 1 {
		var err error
		if known, err = c.deviceDigests(); err != nil {
			g.stats.syncFailures.Add(1)
			return err
		}
	}
	if err := verify.CompareDigests(c.vr, digests, known, c.digest, what); err != nil {
		g.stats.syncFailures.Add(1)
		return err
	}
	return nil
}

// landedDigest is a synced range's digest taken as it landed, if the
// target took one. CompareDigests asks for the ranges in order, and they
// landed in that order: each is looked for first right after the last
// one found.
func (c *syncCall) landedDigest(r desc.Range) (uint64, bool) {
	for c.set < len(c.landed) && c.at >= c.landed[c.set].Len() {
		c.set, c.at = c.set+1, 0
	}
	if c.set < len(c.landed) {
		if d, here, ok := c.landed[c.set].DigestAt(c.at, r.Addr, r.Len); here {
			c.at++
			if ok {
				c.g.stats.digestsLanded.Add(1)
			}
			return d, ok
		}
	}
	for k, l := range c.landed { // out of order: search, and go on from there
		if d, at, ok := l.Digest(r.Addr, r.Len); at >= 0 {
			c.set, c.at = k, at+1
			if ok {
				c.g.stats.digestsLanded.Add(1)
				return d, true
			}
		}
	}
	return 0, false
}

// deviceDigests reads the digests of every synced range at once where
// some are in device memory (staged a run at a time, not a range at a
// time), and returns the lookup CompareDigests asks first: a digest taken
// as the range landed, else the one just read.
func (c *syncCall) deviceDigests() (func(desc.Range) (uint64, bool), error) {
	addrs, lens, read := make([]uint64, len(c.vr)), make([]uint64, len(c.vr)), make([]uint64, len(c.vr))
	for i, r := range c.vr {
		addrs[i], lens[i] = r.Addr, r.Len
	}
	if err := c.g.regions.Digests(addrs, lens, read); err != nil {
		return nil, err
	}
	c.g.stats.digestsRead.Add(int64(len(read)))
	next := 0
	return func(r desc.Range) (uint64, bool) {
		i := next
		next++
		if d, ok := c.landedDigest(r); ok {
			return d, true
		}
		return read[i], true
	}, nil
}

// readDigest is a synced range's digest read from memory.
func (c *syncCall) readDigest(r desc.Range) (uint64, error) {
	c.g.stats.digestsRead.Add(1)
	return c.g.regions.Digest(r.Addr, r.Len)
}
