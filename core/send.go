package core

import (
	"context"
	"errors"
	"fmt"
	mrand "math/rand/v2"
	"slices"
	"time"

	"github.com/mcguard/mcguard/core/desc"
	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/core/memory"
	"github.com/mcguard/mcguard/core/reuse"
	"github.com/mcguard/mcguard/core/transport"
	"github.com/mcguard/mcguard/verify"
)

// The sender: a batch's checks, its session, its chunks delivered and
// verified (verify.Deliver), and its completion notices.

// TransferOptions adjusts one call.
type TransferOptions struct {
	Verify   *verify.Mode  // nil: the guard's mode
	Digests  []uint64      // if len(descs): filled with each source's digest (xxh3-64)
	NoNotice bool          // do not send a completion notice even where the guard would
	Deadline time.Duration // > 0: the transfer fails with ErrTimeout past it
}

// TransferResult describes a transfer: a successful one, or for a failed
// one what is known of its bytes still on their way.
type TransferResult struct {
	ID      uint64
	Retries int
	Resends int
	Abort   AbortState // after a failure: whether the target said nothing more lands
}

// Transfer writes every descriptor to session and returns nil only after
// the configured verification confirmed the bytes at the target.
func (g *Guard) Transfer(name string, descs []desc.Desc, opts TransferOptions) (TransferResult, error) {
	if err := g.enter(); err != nil {
		return TransferResult{}, err
	}
	defer g.leave()
	g.stats.transfers.Add(1)
	start := time.Now()
	res, err := g.transfer(name, descs, opts)
	mode := string(g.cfg.Verify.Mode)
	if opts.Verify != nil {
		mode = string(*opts.Verify)
	}
	took := time.Since(start)
	g.stats.transferNanos.Add(int64(took))
	g.metrics.transferSeconds.Observe(took.Seconds(), mode)
	defer func() { g.metrics.transfers.Add(1, mode, outcomeOf(err)) }()
	if err != nil {
		g.stats.failed.Add(1)
		if res.Abort == AbortConfirmed {
			g.stats.abortsConfirmed.Add(1)
		} else if res.Abort == AbortUnconfirmed {
			g.stats.abortsUnconfirmed.Add(1)
		}
		if res.Abort != AbortNone {
			g.metrics.aborts.Add(1, res.Abort.String())
		}
		if errors.Is(err, errs.Verify) {
			g.stats.verifyFailures.Add(1)
			g.metrics.mismatches.Add(1)
		}
		if g.ctx.Err() != nil && !errors.Is(err, errs.Closed) {
			err = fmt.Errorf("%w while the transfer was in flight: %v", errs.Closed, err)
		}
		return res, err
	}
	g.stats.ok.Add(1)
	return res, nil
}

// checkBatch validates a batch whose local side is Src and remote side
// Dst, and returns its byte count.
func (g *Guard) checkBatch(name string, descs []desc.Desc) (uint64, error) {
	if len(descs) == 0 {
		return 0, fmt.Errorf("%w: a transfer needs at least one descriptor", errs.InvalidArg)
	}
	if len(descs) > MaxDescriptors {
		return 0, fmt.Errorf("%w: %d descriptors, limit %d per call", errs.InvalidArg, len(descs), MaxDescriptors)
	}
	if err := g.checkSession(name); err != nil {
		return 0, err
	}
	var total uint64
	for i, d := range descs {
		if d.Len == 0 {
			return 0, fmt.Errorf("%w: descriptor %d has length 0", errs.InvalidArg, i)
		}
		if err := g.regions.Check(d.Src, d.Len); err != nil {
			return 0, fmt.Errorf("descriptor %d local side: %w", i, err)
		}
		if d.Dst+d.Len < d.Dst {
			return 0, fmt.Errorf("%w: descriptor %d remote address %#x+%d wraps", errs.InvalidArg, i, d.Dst, d.Len)
		}
		total += d.Len
	}
	return total, nil
}

// lockSession returns name's session locked, connected, and with a region
// table that covers every remote range of descs. The caller unlocks it.
func (g *Guard) lockSession(ctx context.Context, name string, descs []desc.Desc) (*session, error) {
	s := g.session(name)
	s.mu.Lock()
	err := s.connect(ctx, g)
	if err == nil && g.engine == nil { // an engine checks its peers' tables itself
		if i := s.checkDst(descs); i >= 0 {
			if err = s.refresh(ctx, g); err == nil {
				if i = s.checkDst(descs); i >= 0 {
					err = fmt.Errorf("descriptor %d remote side: %w at session %s: [%#x, +%d)", i, errs.NotRegistered, name, descs[i].Dst, descs[i].Len)
				}
			}
		}
	}
	if err != nil {
		s.mu.Unlock()
		return nil, err
	}
	return s, nil
}

func (g *Guard) transfer(name string, descs []desc.Desc, opts TransferOptions) (res TransferResult, err error) {
	total, err := g.checkBatch(name, descs)
	if err != nil {
		return res, err
	}
	vcfg := g.cfg.Verify
	if opts.Verify != nil {
		vcfg.Mode = *opts.Verify
	}
	ss := g.session(name)
	ctx, c := ss.callContext(g.ctx, opts.Deadline)
	defer ss.endCall(c)
	s, err := g.lockSession(ctx, name, descs)
	if err != nil {
		return res, callErr(ctx, err)
	}
	defer s.mu.Unlock()
	if err = s.holdSources(g, descs); err != nil {
		return res, err
	}
	defer s.releaseSources() // after the abort below: nothing of the transfer reads a source once it is let go
	if err = s.beginTransfer(ctx); err != nil {
		s.disconnect()
		return res, fmt.Errorf("session %s: %w", name, callErr(ctx, err))
	}
	defer s.endTransfer()
	r := chunks{g: g, s: s, ctx: ctx, descs: descs, opts: opts, vcfg: vcfg, seed: mrand.Uint64()}
	defer func() {
		if err != nil && r.sent { // a write may have left: a failure needs the abort
			res.Abort = g.abortRemote(s)
		}
	}()
	res.ID = g.ids.give()
	r.id = res.ID
	if t := s.caps().Tagged; t != nil {
		// Over an engine, calls count for this transfer until they
		// return (WaitEngineCalls); the session's later calls are not its.
		t.SetTransfer(res.ID)
		defer t.SetTransfer(0)
	}
	r.notify = !opts.NoNotice && vcfg.Notifies()
	// A read-back mode without notices posts each chunk's writes while the
	// chunk before it is checked (verify.Pipeline, post_ahead): with
	// notices, each goes after its chunk's check, before the next chunk's
	// writes.
	r.pipelined = vcfg.Mode.ReadsBack() && !r.notify && g.cfg.PostAhead
	for base := 0; base < len(descs); base += g.cfg.MaxBatch {
		err = r.deliver(base)
		res.Retries, res.Resends = r.retries, r.resends
		if err != nil {
			return res, fmt.Errorf("session %s: %w", name, callErr(ctx, err))
		}
		if g.afterChunk != nil {
			g.afterChunk(base)
		}
	}
	g.stats.descriptors.Add(int64(len(descs)))
	g.stats.bytes.Add(int64(total))
	g.metrics.descriptors.Add(int64(len(descs)), string(vcfg.Mode))
	g.metrics.bytes.Add(int64(total), string(vcfg.Mode))
	return res, nil
}

// chunks is one transfer's run of chunks of at most max_batch
// descriptors, under its session's lock: each delivered and checked in
// turn, with its digests and notice.
type chunks struct {
	g     *Guard
	s     *session
	ctx   context.Context
	descs []desc.Desc
	opts  TransferOptions
	vcfg  verify.Config
	id    uint64 // the transfer's
	seed  uint64
	// retries and resends: the chunks' so far (the transfer's result)
	retries, resends int
	// notify: each chunk's notice goes after its check; pipelined: each
	// chunk's writes go while the chunk before it is checked (pipe).
	notify, pipelined bool
	pipe              verify.Pipeline
	sent              bool // a write may have left
}

// deliver delivers the chunk that starts at descriptor base.
func (r *chunks) deliver(base int) error {
	g, s, descs := r.g, r.s, r.descs
	chunk := descs[base:min(base+g.cfg.MaxBatch, len(descs))]
	r.pipe = verify.Pipeline{Posted: r.pipe.NextPosted}
	if next := base + len(chunk); r.pipelined && next < len(descs) {
		r.pipe.Next, r.pipe.NextBase = descs[next:min(next+g.cfg.MaxBatch, len(descs))], next
	}
	// A posted chunk's acknowledgements are owed ahead of any notice's
	// answer; the chunk before it settled the notices.
	if !r.pipe.Posted {
		if err := g.settleNotices(r.ctx, s); err != nil {
			s.disconnect()
			return err
		}
	}
	var digests []uint64
	var digestErr error
	var digesting <-chan error // the sources' digests still being taken
	if r.vcfg.Mode == verify.Digest || r.opts.Digests != nil {
		digests = slices.Grow(reuse.Keep(s.digests), len(chunk))[:len(chunk)]
		s.digests = digests
		if chunkBytes(chunk) <= inlineDigestBytes {
			// Cheaper than a goroutine hand-off from a C caller's thread.
			digestErr = g.digestSources(chunk, digests)
		} else {
			// Digest the sources while the writes go out: the source
			// must not change during a transfer, so both see the same bytes.
			digesting = g.digestInBackground(&s.digestJob, chunk, digests)
		}
	}
	wait := func() error {
		if digesting != nil {
			digestErr = <-digesting
			digesting = nil
		}
		return digestErr
	}
	var announce func(fenceFollows bool) error
	if r.notify {
		announce = func(fenceFollows bool) error {
			if err := wait(); err != nil {
				return err
			}
			return g.notify(r.ctx, s, r.id, r.vcfg.Mode, len(descs), base, chunk, digests, fenceFollows)
		}
	}
	r.sent = true
	d, err := g.deliver(r.ctx, s, r.vcfg, r.seed, chunk, base, announce, &r.pipe)
	r.count(d)
	if err != nil && !isMismatch(err) {
		s.disconnect() // the connection is in an unknown state
	}
	if werr := wait(); err == nil { // never return while the digest goroutine still reads the sources
		err = werr
	}
	if err == nil && r.opts.Digests != nil {
		copy(r.opts.Digests[base:], digests)
	}
	return err
}

// count adds a chunk's delivery to the transfer's result, the stats and
// the metrics.
func (r *chunks) count(d verify.Delivery) {
	g := r.g
	if r.pipe.NextPosted {
		g.stats.pipelined.Add(1)
	}
	r.retries += d.Retries
	r.resends += d.Resends
	g.stats.retries.Add(int64(d.Retries))
	g.stats.resends.Add(int64(d.Resends))
	g.stats.probed.Add(d.Probed)
	g.metrics.retries.Add(int64(d.Retries))
	g.metrics.resends.Add(int64(d.Resends))
	g.stats.checkNanos.Add(int64(d.Checked))
	g.metrics.verifySeconds.Observe(d.Checked.Seconds(), string(r.vcfg.Mode))
}

// deliver writes and checks one chunk over s's connection
// (verify.Deliver), and recovers once where the session's view of the
// receiver, not the bytes, was out of date (writing the chunk again, and
// posting nothing behind it).
func (g *Guard) deliver(ctx context.Context, s *session, vcfg verify.Config, seed uint64, chunk []desc.Desc, base int, announce func(fenceFollows bool) error, pipe *verify.Pipeline) (verify.Delivery, error) {
	d, err := verify.Deliver(ctx, vcfg, seed, s.checked(), chunk, base, g.view, &s.scratch, announce, pipe)
	switch {
	case err == nil:
	case errors.Is(err, errUnknownToken) && vcfg.Mode == verify.Digest && announce != nil:
		// The receiver forgot this session's handshake while the data
		// connection lived on: the chunk is fenced; shake hands again
		// and announce it once more (a stray case announcing bytes not
		// written still fails, at the receiver's digest comparison).
		if err = s.refresh(ctx, g); err == nil {
			if err = announce(true); err == nil {
				err = s.conn.Fence(ctx)
			}
		}
	case errors.Is(err, transport.ErrJoinRefused) && vcfg.Mode != verify.Digest:
		// The receiver cut a region in two since the handshake: shake
		// hands again for its table, on a new connection, and write the
		// chunk once more, each run inside one of its regions now
		// (digest mode's notice may be out already: it fails instead).
		epoch, bound := s.epoch()
		s.disconnect()
		if err = s.connect(ctx, g); err == nil && bound {
			err = s.caps().Transfers.Continue(ctx, epoch) // the same transfer: under the quiesces it began under
		}
		if err == nil {
			var again verify.Delivery
			again, err = verify.Deliver(ctx, vcfg, seed, s.checked(), chunk, base, g.view, &s.scratch, announce, nil)
			d.Add(again)
		}
	}
	return d, err
}

// beginTransfer puts the transfer's writes under the quiesces the
// receiver had announced when it began (transport.TransferBound).
func (s *session) beginTransfer(ctx context.Context) error {
	if tb := s.caps().Transfers; tb != nil {
		return tb.BeginTransfer(ctx)
	}
	return nil
}

func (s *session) endTransfer() {
	if tb := s.caps().Transfers; tb != nil {
		tb.EndTransfer()
	}
}

// epoch is the quiesce generation the transfer's writes go under, where
// the connection has one.
func (s *session) epoch() (uint64, bool) {
	if tb := s.caps().Transfers; tb != nil {
		return tb.Epoch(), true
	}
	return 0, false
}

// holdSources keeps the region of every source registered until
// releaseSources: an Unregister meanwhile waits for the transfer, so no
// part of it (a write, a read-back's comparison, a digest) reads memory
// that the application freed after Unregister returned.
func (s *session) holdSources(g *Guard, descs []desc.Desc) error {
	s.held = s.held[:0]
	var in memory.Region // the region held last: consecutive sources in it need no hold of their own
	for i, d := range descs {
		if d.Src >= in.Addr && d.Src+d.Len <= in.End() && in.Len != 0 {
			continue
		}
		h, r, _, err := g.regions.HoldRegion(d.Src, d.Len, nil)
		if err != nil {
			s.releaseSources()
			return fmt.Errorf("descriptor %d local side: %w", i, err)
		}
		s.held, in = append(s.held, h), r
	}
	return nil
}

func (s *session) releaseSources() {
	for _, h := range s.held {
		h.Release()
	}
	s.held = s.held[:0]
}

// isMismatch reports whether err is a verification mismatch (the
// connection is in step) rather than a failure that leaves it unknown.
// Its own function: the target of errors.As escapes, and declared in the
// caller it would be allocated for every transfer.
func isMismatch(err error) bool {
	var mismatch *verify.MismatchError
	return errors.As(err, &mismatch)
}

// digestSources takes each source's digest into digests: a chunk of
// device memory staged together (regions.Digests); host memory one by
// one in place, allocating nothing.
func (g *Guard) digestSources(chunk []desc.Desc, digests []uint64) (err error) {
	if len(chunk) > 1 && g.onDevice(chunk[0].Src, chunk[0].Len) {
		addrs, lens := make([]uint64, len(chunk)), make([]uint64, len(chunk))
		for i, d := range chunk {
			addrs[i], lens[i] = d.Src, d.Len
		}
		return g.regions.Digests(addrs, lens, digests[:len(chunk)])
	}
	for i, d := range chunk {
		if digests[i], err = g.regions.Digest(d.Src, d.Len); err != nil {
			return err
		}
	}
	return nil
}

// onDevice reports whether [addr, +n) is registered device memory.
func (g *Guard) onDevice(addr, n uint64) bool {
	if g.regions.GPU() == nil {
		return false
	}
	mem, err := g.regions.Memory(addr, n)
	return err == nil && mem.Device
}

// inlineDigestBytes: a chunk this small is digested before its writes go
// out (tens of µs) rather than beside them on another goroutine.
const inlineDigestBytes = 256 << 10

func chunkBytes(chunk []desc.Desc) uint64 {
	var n uint64
	for _, d := range chunk {
		n += d.Len
	}
	return n
}

func modeIndex(m verify.Mode) uint8 {
	for i, x := range verify.Modes {
		if x == m {
			return uint8(i)
		}
	}
	return 0
}
