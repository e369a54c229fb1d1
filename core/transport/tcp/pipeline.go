package tcp

// A chunk's read-back with the next chunk's writes behind it
// (transport.Pipeliner): the fence and the read request go out, then the
// next chunk's writes on the connection's poster goroutine, while the
// caller reads this chunk's acknowledgements and answer and compares them.
// Without it the two ends take turns: the target waits while the sender
// compares, and the sender waits while the target applies and answers.
// The target sends a read-back's answer at once (target.go), not after
// the writes already behind it.

import (
	"context"

	"github.com/mcguard/mcguard/core/desc"
	"github.com/mcguard/mcguard/core/wire"
)

// postJob is one chunk's writes for the poster goroutine.
type postJob struct {
	ctx   context.Context
	descs []desc.Desc
	base  int
}

// poster is a connection's second goroutine, started at its first
// pipelined read-back and ended by Close. Sent a job, it posts the writes
// into its own list of owed acknowledgements (owed, which the caller
// swapped in) and answers on done. While it runs it alone writes to the
// connection, and the caller alone reads.
type poster struct {
	jobs chan postJob
	done chan error
}

// ReadPosting reads ranges back after a fence, with next's writes posted
// behind the read request. It declines (posts nothing, reads as
// ReadArriving) where next would need more than this: on the same host
// (pulled or pushed writes), for a read of more than one request, or a
// chunk of more frames than are left owed without reading (maxOwed): the
// poster never reads.
func (t *conn) ReadPosting(ctx context.Context, ranges []desc.Range, out []byte, arrived func(uint64), next []desc.Desc, nextBase int) (bool, error) {
	if t.pull || t.lease != nil || len(next) == 0 || countSlices(next) >= maxOwed ||
		len(ranges) > wire.MaxRanges || uint64(len(out)) > wire.MaxPayload { // out: the ranges' bytes
		return false, t.ReadArriving(ctx, ranges, out, true, arrived)
	}
	defer t.abortOn(ctx)()
	t.deadline(ctx) // the poster renews only the write deadline (renew): the read one is ours
	if err := t.send(wire.Header{Op: wire.OpFence}, nil); err != nil {
		return false, err
	}
	fenceID := t.nextID
	payload, _ := t.readPayload(ranges)
	if err := t.send(wire.Header{Op: wire.OpRead, Len: uint64(len(payload))}, payload); err != nil {
		return false, err
	}
	readID := t.nextID
	if err := t.w.Flush(); err != nil {
		return false, ioErr("send", err)
	}

	// Hand the connection's writing side to the poster, with an empty
	// list of owed acknowledgements for next's writes.
	mine := t.owed
	t.owed, t.spareOwed = t.spareOwed[:0], nil
	if t.poster == nil {
		t.poster = &poster{jobs: make(chan postJob), done: make(chan error, 1)}
		go t.poster.run(t)
	}
	t.poster.jobs <- postJob{ctx: ctx, descs: next, base: nextBase}

	err := t.readAnswered(mine, fenceID, readID, out, arrived)
	if err != nil {
		t.cut() // the poster may be blocked writing to a target that stopped reading
	}
	postErr := <-t.poster.done
	t.spareOwed = mine[:0] // no sources to let go: pulled writes are declined
	if err != nil {
		return false, err
	}
	if postErr != nil {
		return false, postErr
	}
	return true, nil // next's writes left the connection unfenced (sendWrites)
}

// readAnswered reads the replies owed before a pipelined read-back, its
// fence's and its own, the bytes into out.
func (t *conn) readAnswered(owed []owedAck, fenceID, readID uint64, out []byte, arrived func(uint64)) error {
	h, err := t.fencedReply(owed, fenceID, readID)
	if err != nil {
		return err
	}
	if err := answerErr(h, uint64(len(out))); err != nil {
		return err
	}
	return t.readReply(out, 0, arrived)
}

func (p *poster) run(t *conn) {
	for j := range p.jobs {
		p.done <- t.sendWrites(j.ctx, j.descs, j.base, false)
	}
}

// stop ends the poster goroutine (Close).
func (p *poster) stop() { close(p.jobs) }
