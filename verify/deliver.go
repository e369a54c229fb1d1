package verify

import (
	"context"
	"errors"
	"fmt"
	"github.com/mcguard/mcguard/core/desc"
	"github.com/mcguard/mcguard/core/transport"
	"time"
)

// Pipeline carries a chunk's writes across two Deliver calls (transport.Pipeliner).
type Pipeline struct {
	Posted   bool        // in: this chunk's writes went out during the previous chunk's check
	Next     []desc.Desc // in: the chunk after this one, to post during this one's check (nil: none)
	NextBase int         // in: Next[0]'s index in the batch
	// NextPosted (out): Next's writes went out, and this chunk was
	// delivered; the next Deliver must say Posted.
	NextPosted bool
}

// Delivery counts what Deliver did for one chunk, also when it failed.
type Delivery struct {
	Retries int           // polling rounds after the first read-back
	Resends int           // rounds of writing descriptors again
	Probed  int64         // bytes read back
	Checked time.Duration // spent on the fence and verification, after the writes
}

// Add counts o's work in d too (a chunk delivered again).
func (d *Delivery) Add(o Delivery) {
	d.Retries += o.Retries
	d.Resends += o.Resends
	d.Probed += o.Probed
	d.Checked += o.Checked
}

// Deliver writes one chunk over conn and checks it as cfg says: read-back
// modes fence, read back (the fence pipelined with the first read, so one
// round trip), poll, and re-send what never matched when OnMismatch says
// so; digest mode fences and leaves the comparison to the receiver; off
// trusts the transport. announce, if not nil, sends the chunk's notice:
// after the check, or in digest mode while the fence is in flight (the
// receiver's sync waits for the writes anyway); its argument says whether
// a Fence on conn follows at once (a connection that carries notices may leave the notice
// for that fence to send). base is chunk[0]'s index
// in the batch; a MismatchError names batch indices. Any other error
// leaves conn in an unknown state: the caller drops it. pipe (nil: none)
// posts the next chunk during this one's first read-back where conn is a
// Pipeliner and the read-back is one request of the whole chunk: a
// re-send or a second window would otherwise read the next chunk's bytes
// where both chunks write the same place.
func Deliver(ctx context.Context, cfg Config, seed uint64, conn transport.Conn, chunk []desc.Desc, base int, local LocalFunc, scratch *Scratch, announce func(fenceFollows bool) error, pipe *Pipeline) (d Delivery, err error) {
	var pipeliner transport.Pipeliner
	if pipe != nil {
		pipe.NextPosted = false
		pipeliner = conn.Caps().ReadPosting
		if len(pipe.Next) == 0 {
			pipeliner = nil
		}
		defer func() { pipe.NextPosted = pipe.NextPosted && err == nil }()
	}
	if announce == nil {
		announce = func(bool) error { return nil }
	}
	if pipe == nil || !pipe.Posted {
		if err := writeChunk(ctx, conn, cfg.Mode, chunk, base); err != nil {
			return d, err
		}
	}
	start := time.Now()
	defer func() { d.Checked = time.Since(start) }()
	switch {
	case cfg.Mode == Off:
		return d, announce(false)
	case !cfg.Mode.ReadsBack():
		return d, fenceAnnouncing(ctx, conn, announce)
	}
	b := readBack{cfg: cfg, seed: seed, conn: conn, base: base, local: local, scratch: scratch, pipeliner: pipeliner}
	if pipeliner != nil {
		b.next, b.nextBase = pipe.Next, pipe.NextBase
	}
	err = b.run(ctx, chunk, &d)
	if pipe != nil {
		pipe.NextPosted = b.nextPosted
	}
	if err == nil {
		err = announce(false)
	}
	return d, err
}

// writeChunk sends descs as mode wants them sent: off trusts the write's
// completion, so it waits for it; every other mode fences or reads back
// next, which collects the completions (Caps.Post); digest mode's are marked
// for the target to digest as they land (Caps.PostMarked). (A call, not
// a method value chosen once: a method value would be allocated.)
func writeChunk(ctx context.Context, conn transport.Conn, mode Mode, descs []desc.Desc, base int) error {
	caps := conn.Caps()
	if caps.PostMarked != nil && mode == Digest {
		return caps.PostMarked.PostMarked(ctx, descs, base)
	}
	if caps.Post != nil && mode != Off {
		return caps.Post.Post(ctx, descs, base)
	}
	return conn.Write(ctx, descs, base)
}

// fenceAnnouncing is digest mode's check at the sender: a fence, with the
// chunk's notice sent meanwhile (the receiver's sync compares).
func fenceAnnouncing(ctx context.Context, conn transport.Conn, announce func(fenceFollows bool) error) error {
	if conn.Caps().Notices != nil {
		// The notice follows the writes on the connection: the fence
		// reads their replies and its own in one flight.
		if err := announce(true); err != nil {
			return err
		}
		return conn.Fence(ctx)
	}
	fenced := make(chan error, 1)
	go func() { fenced <- conn.Fence(ctx) }()
	notified := announce(false)
	if err := <-fenced; err != nil {
		return err
	}
	return notified
}

// readBack is a read-back mode's check of one chunk: read back (the
// fence pipelined with the first read), poll where the fence is not
// final, and re-send what never matched where OnMismatch says so.
type readBack struct {
	cfg       Config
	seed      uint64
	conn      transport.Conn
	base      int // the chunk's first descriptor in the batch
	local     LocalFunc
	scratch   *Scratch
	pipeliner transport.Pipeliner // posts next during the first read-back; nil: none
	// next and nextBase: the chunk after this one (Pipeline.Next); its
	// writes went out where nextPosted. (Not the Pipeline itself: a
	// pointer kept here would move the caller's to the heap.)
	next       []desc.Desc
	nextBase   int
	nextPosted bool
}

// run checks chunk, counting in d, until it matched (nil), a re-send is
// not allowed any more (a MismatchError naming batch indices) or
// something else failed.
func (b *readBack) run(ctx context.Context, chunk []desc.Desc, d *Delivery) error {
	cfg := b.cfg
	final := b.conn.FenceIsFinal()
	if final {
		cfg.MaxRetries = 0 // re-send or fail at once
	} else {
		b.pipeliner = nil // polling would read the next chunk's bytes too
	}
	// index maps positions in the descriptors being checked to the batch
	// (nil until a re-send: position i is base+i).
	todo, index := chunk, []int(nil)
	streams := b.conn.Caps().ReadArriving
	for attempt := 0; ; attempt++ {
		fenced := false
		read := func(ctx context.Context, ranges []desc.Range, out []byte, arrived func(uint64)) error {
			first := !fenced
			fenced = true
			if first && attempt == 0 && b.pipeliner != nil && len(ranges) == b.scratch.planned() {
				posted, err := b.pipeliner.ReadPosting(ctx, ranges, out, arrived, b.next, b.nextBase)
				b.nextPosted = posted
				return err
			}
			if streams != nil {
				return streams.ReadArriving(ctx, ranges, out, first, arrived)
			}
			return b.conn.Read(ctx, ranges, out, first)
		}
		r, err := Check(ctx, cfg, b.seed, todo, b.local, read, b.scratch)
		d.Retries += r.Retries
		d.Probed += r.Probed
		if err == nil {
			return nil
		}
		me := asMismatch(err)
		if me == nil {
			return err
		}
		var bad []desc.Desc
		bad, index = b.inBatch(me, todo, index)
		if cfg.OnMismatch != Resend || attempt >= cfg.MaxResends {
			switch {
			case attempt > 0:
				me.Where = fmt.Sprintf("still differ at the target after %d re-sends", attempt)
			case final:
				me.Where = "differ at the target after a fence that said every earlier write was applied"
			}
			return me
		}
		d.Resends++
		todo = bad
		if err := writeChunk(ctx, b.conn, b.cfg.Mode, todo, 0); err != nil {
			return err
		}
	}
}

// inBatch turns a mismatch's positions in todo (mapped through index, or
// from base where nil) into batch indices, and returns the descriptors
// that differed with their batch indices, for a re-send.
func (b *readBack) inBatch(me *MismatchError, todo []desc.Desc, index []int) ([]desc.Desc, []int) {
	bad, badIndex := make([]desc.Desc, len(me.Descs)), make([]int, len(me.Descs))
	for i, k := range me.Descs {
		bad[i], badIndex[i] = todo[k], b.base+k
		if index != nil {
			badIndex[i] = index[k]
		}
	}
	me.Descs = badIndex
	return bad, badIndex
}

// Notify settings: when a transfer sends the receiving guard a completion
// notice.
const (
	NotifyAuto   = "auto"   // in digest mode only: the receiver needs the digests
	NotifyAlways = "always" // every transfer, so the receiver can sync by id
	NotifyNever  = "never"  // the application forwards what the receiver needs
)

// Notifies reports whether a transfer under c sends a completion notice.
func (c Config) Notifies() bool {
	return c.Notify == NotifyAlways || (c.Notify == NotifyAuto && c.Mode == Digest)
}

// asMismatch is err's MismatchError, or nil; its own function, so that
// nothing is allocated for a check that passed.
func asMismatch(err error) *MismatchError {
	var me *MismatchError
	if errors.As(err, &me) {
		return me
	}
	return nil
}
