package tcp

// The sender's fence and read-backs: a fence after posted writes, and
// reads of the target's bytes, the first one pipelined with the fence.

import (
	"context"
	"fmt"
	"io"
	"slices"

	"github.com/mcguard/mcguard/core/desc"
	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/core/transport"
	"github.com/mcguard/mcguard/core/wire"
)

// fencedRequest sends a Read after the unanswered Fence fenceID and waits
// for both replies.
func (t *conn) fencedRequest(ctx context.Context, fenceID uint64, payload []byte) (wire.Header, error) {
	if err := t.send(wire.Header{Op: wire.OpRead, Len: uint64(len(payload))}, payload); err != nil {
		return wire.Header{}, err
	}
	if err := t.w.Flush(); err != nil {
		return wire.Header{}, ioErr("send", err)
	}
	h, err := t.fencedReply(t.owed, fenceID, t.nextID)
	t.dropOwed(len(t.owed))
	return h, err
}

// fencedReply reads the replies to the frames owed before fence fenceID,
// the fence's, and the header of read readID's: an I/O error, else the
// first refusal among the owed, else the fence's failure, else the read's
// header. Shared by the plain and the pipelined read-back.
func (t *conn) fencedReply(owed []owedAck, fenceID, readID uint64) (wire.Header, error) {
	refused, err := t.collect(owed)
	if err != nil {
		return wire.Header{}, err
	}
	f, err := t.recv(wire.OpFence, fenceID)
	switch {
	case err != nil:
		return wire.Header{}, err
	case refused != nil:
		// A refused write: the read's reply still comes; the caller drops
		// the connection anyway (the error is not a mismatch).
		return wire.Header{}, refused
	}
	if err := fenceErr(f); err != nil {
		return wire.Header{}, err
	}
	return t.recv(wire.OpRead, readID)
}

// fenceErr is what a fence's reply says: nil, or that the target failed it.
func fenceErr(h wire.Header) error {
	if h.Status != wire.StatusOK {
		return fmt.Errorf("%w: target failed the fence: %v", errs.Peer, h.Status)
	}
	return nil
}

// readPayload is a Read frame's payload for ranges, in the connection's
// reused buffer, and the bytes its answer carries.
func (t *conn) readPayload(ranges []desc.Range) (payload []byte, total uint64) {
	payload = t.readReq[:0]
	for _, r := range ranges {
		payload = wire.AppendRange(payload, r.Addr, r.Len)
		total += r.Len
	}
	t.readReq = payload
	return payload, total
}

// answerErr is what a read-back's reply h says of an answer of total
// bytes: nil, or why there is none.
func answerErr(h wire.Header, total uint64) error {
	if h.Status != wire.StatusOK {
		return fmt.Errorf("%w: target refused a read-back: %v", statusErr(h.Status), h.Status)
	}
	if h.Len != total {
		return fmt.Errorf("%w: read-back of %d bytes answered with %d", errs.Peer, total, h.Len)
	}
	return nil
}

// Fence returns once every earlier write on this connection is applied:
// the target's answer to a fence frame, or where the target's answers
// to writes are final, those answers.
func (t *conn) Fence(ctx context.Context) error {
	if !t.unfenced && !slices.ContainsFunc(t.owed, notNotice) {
		// No write went through the socket: pushed writes are in place.
		// A notice posted after them is sent, and its answer left owed
		// for the session's next call to read first (SettleNotices): the
		// transfer costs no round trip.
		if err := t.w.Flush(); err != nil {
			return ioErr("send", err)
		}
		return nil
	}
	if t.acksFence() {
		// A notice posted behind the writes is answered after them, so
		// it is taken when this returns, as behind a fence. (readOwed
		// watches ctx itself.)
		if err := t.readOwed(ctx); err != nil {
			return err
		}
		t.unfenced = false
		return nil
	}
	defer t.abortOn(ctx)()
	h, err := t.request(ctx, wire.OpFence, nil)
	if err != nil {
		return err
	}
	if err := fenceErr(h); err != nil {
		return err
	}
	t.unfenced = false
	return nil
}

// acksFence: the target's answers to the writes say all its fence would
// (it answers each write once it is in place, and holds none back), so
// a fence is those answers, without a frame of its own. Not where
// replies are tagged: a fence's answer is, a write's is not.
func (t *conn) acksFence() bool { return t.acksFinal && t.mac == nil }

// Read fetches ranges into out, one request per wire.MaxRanges ranges or
// wire.MaxPayload bytes. With fenced, the first request's replies are
// read after every earlier write's: a Fence frame precedes it (where the
// writes' answers are not the fence, acksFence), both replies read after
// one flush: one round trip.
func (t *conn) Read(ctx context.Context, ranges []desc.Range, out []byte, fenced bool) error {
	return t.ReadArriving(ctx, ranges, out, fenced, nil)
}

// ReadArriving is Read calling arrived (if not nil) as the bytes come in,
// with how many of out's leading bytes are in place
// (transport.StreamReader).
func (t *conn) ReadArriving(ctx context.Context, ranges []desc.Range, out []byte, fenced bool, arrived func(uint64)) error {
	if t.lease != nil && !t.unfenced {
		if done, err := t.pullRanges(ranges, out); done || err != nil {
			return err
		}
	}
	defer t.abortOn(ctx)()
	var fenceID uint64
	if fenced && !t.acksFence() { // else the read's request reads the writes' answers first
		t.deadline(ctx)
		if err := t.send(wire.Header{Op: wire.OpFence}, nil); err != nil {
			return err
		}
		fenceID = t.nextID
	}
	if err := t.readRanges(ctx, ranges, out, fenceID, arrived); err != nil {
		return err
	}
	if fenced {
		t.unfenced = false
	}
	return nil
}

// readRanges does Read's requests; a fenceID other than 0 is a Fence sent
// but not yet answered, whose reply comes before the first read's.
func (t *conn) readRanges(ctx context.Context, ranges []desc.Range, out []byte, fenceID uint64, arrived func(uint64)) error {
	var before uint64 // out's bytes read by earlier requests
	size := func(i int) uint64 { return ranges[i].Len }
	for start, end := range transport.Groups(len(ranges), size, wire.MaxRanges, wire.MaxPayload) {
		payload, total := t.readPayload(ranges[start:end])
		var h wire.Header
		var err error
		if fenceID != 0 {
			h, err = t.fencedRequest(ctx, fenceID, payload)
			fenceID = 0
		} else {
			h, err = t.request(ctx, wire.OpRead, payload)
		}
		if err != nil {
			return err
		}
		if err := answerErr(h, total); err != nil {
			return err
		}
		if err := t.readReply(out[:total], before, arrived); err != nil {
			return err
		}
		out, before = out[total:], before+total
	}
	return nil
}

// readReply reads a read-back reply's bytes into b, telling arrived (if
// not nil) after each piece how many of the read's bytes are in: before
// came in earlier requests.
// Where replies are tagged, the tag after the bytes is checked before it
// returns: what arrived compared is believed only if it returns nil.
func (t *conn) readReply(b []byte, before uint64, arrived func(uint64)) error {
	if arrived == nil {
		if _, err := io.ReadFull(t.r, b); err != nil {
			return ioErr("receive", err)
		}
	} else {
		for got := 0; got < len(b); {
			k, err := t.r.Read(b[got:])
			got += k
			if k > 0 {
				arrived(before + uint64(got))
			}
			if err != nil && got < len(b) {
				return ioErr("receive", err)
			}
		}
	}
	if t.mac != nil {
		t.mac.Write(b)
		return t.mac.check(t.r, wire.OpRead)
	}
	return nil
}
