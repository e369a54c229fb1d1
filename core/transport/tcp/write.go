package tcp

// The sender's writes: posted (their acknowledgements read by the next
// request, in the same flight) or written and acknowledged at once, and
// completion notices carried after them on the connection.

import (
	"context"
	"encoding/binary"
	"fmt"
	"slices"

	"github.com/mcguard/mcguard/core/desc"
	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/core/transport"
	"github.com/mcguard/mcguard/core/wire"
)

// owedAck is a posted frame: its id, its op, and for a write its
// descriptor (for messages).
type owedAck struct {
	id     uint64
	op     wire.Op
	desc   int
	joined int // descriptors after desc the write took in too (transport.Cursor)
	// release lets go of a pulled write's source once the target
	// answered: until then it must stay registered.
	release func()
	ipc     bool   // a CUDA IPC write
	notice  uint64 // a notice's transfer id (for messages)
}

// maxOwed bounds the acknowledgements left unread while more frames go
// out: a few dozen bytes each, so far below what the socket buffers hold
// and the target can never block writing them while we still send.
const maxOwed = 1024

// collectOwed reads the replies of posted frames, which come before any
// later reply. It returns an I/O error (the stream is lost), or the first
// refusal among them (the stream is in step: the caller reads on).
func (t *conn) collectOwed() (refused, ioErr error) { return t.collectFirst(len(t.owed)) }

// collectFirst is collectOwed for the oldest n owed replies only; the
// rest stay owed. A source the target has answered for (or, the stream
// lost, never will) is let go.
func (t *conn) collectFirst(n int) (refused, ioErr error) {
	defer func() {
		if ioErr != nil {
			n = len(t.owed)
		}
		t.dropOwed(n)
	}()
	return t.collect(t.owed[:n])
}

// dropOwed takes the oldest n owed frames off the list, letting their
// sources go: the target answered for them, or the stream is lost.
func (t *conn) dropOwed(n int) {
	for _, o := range t.owed[:n] {
		if o.release != nil {
			o.release()
		}
	}
	left := copy(t.owed, t.owed[n:])
	clear(t.owed[left:])
	t.owed = t.owed[:left]
}

// collect reads the replies of the posted frames owed, in order: an I/O
// error, or the first refusal among them. The caller lets their sources go.
func (t *conn) collect(owed []owedAck) (refused, ioErr error) {
	for _, o := range owed {
		h, err := t.recv(o.op, o.id)
		if err != nil {
			return nil, err
		}
		if refused == nil {
			refused = t.judge(o, h)
		}
	}
	return refused, nil
}

// judge is what the reply h to posted frame o says: nil, or a refusal.
func (t *conn) judge(o owedAck, h wire.Header) error {
	switch {
	case h.Status == wire.StatusOK:
		return nil
	case h.Status == wire.StatusNoAccess && o.ipc:
		t.ipc = false
		return fmt.Errorf("%w: target refused %s at %#x: it could not open this process's CUDA IPC handle (the receiver's log says why); later transfers on this connection stage GPU bytes through the socket", errs.Device, o.descriptors(), h.Addr)
	case h.Status == wire.StatusStaleToken:
		return fmt.Errorf("%w: the completion notice of transfer %#x: %w", errs.Session, o.notice, transport.ErrStaleToken)
	case o.op == wire.OpNotice:
		return fmt.Errorf("%w: the receiver refused the completion notice of transfer %#x (%v); its log says why", errs.Session, o.notice, h.Status)
	}
	if h.Status == wire.StatusNotRegistered && o.joined > 0 {
		return fmt.Errorf("%w: target refused %s at %#x: %v (%w)", statusErr(h.Status), o.descriptors(), h.Addr, h.Status, transport.ErrJoinRefused)
	}
	return fmt.Errorf("%w: target refused %s at %#x: %v", statusErr(h.Status), o.descriptors(), h.Addr, h.Status)
}

// descriptors names the descriptors a write carried, for messages.
func (o owedAck) descriptors() string {
	if o.joined == 0 {
		return fmt.Sprintf("descriptor %d", o.desc)
	}
	return fmt.Sprintf("descriptors %d to %d (written as one)", o.desc, o.desc+o.joined)
}

// firstErr is collectOwed's I/O error, else its refusal.
func firstErr(refused, ioErr error) error {
	if ioErr != nil {
		return ioErr
	}
	return refused
}

// owedThen reads the owed replies and then the reply of request id,
// returning an I/O error, else the owed refusal, else the reply.
func (t *conn) owedThen(op wire.Op, id uint64) (wire.Header, error) {
	refused, err := t.collectOwed()
	if err != nil {
		return wire.Header{}, err
	}
	h, err := t.recv(op, id)
	if err != nil {
		return wire.Header{}, err
	}
	return h, refused
}

// Write sends every descriptor, sliced, pipelined, and collects one
// acknowledgement per slice.
func (t *conn) Write(ctx context.Context, descs []desc.Desc, base int) error {
	if t.lease != nil {
		if done, err := t.pushFirst(ctx, descs); done || err != nil {
			return err
		}
	}
	if err := t.Post(ctx, descs, base); err != nil {
		return err
	}
	return t.readOwed(ctx)
}

// Post sends a batch of writes and returns without reading their
// acknowledgements (transport.Poster): the next Fence or Read reads them
// first, so writes, fence and read-backs make one flight. A batch of more
// than maxOwed slices reads the older acknowledgements while its later
// frames go out (sendWrites).
func (t *conn) Post(ctx context.Context, descs []desc.Desc, base int) error {
	return t.post(ctx, descs, base, false)
}

// PostMarked is Post with every frame marked with its descriptor
// (transport.DescriptorMarker), so the target digests each descriptor as it
// lands: digest mode's writes. A target that digests at sync time instead
// (digest_at "sync", the default) has no use for marks, and gets the
// writes as Post sends them: consecutive descriptors joined.
func (t *conn) PostMarked(ctx context.Context, descs []desc.Desc, base int) error {
	return t.post(ctx, descs, base, t.landing)
}

func (t *conn) post(ctx context.Context, descs []desc.Desc, base int, marked bool) error {
	if t.lease != nil {
		if done, err := t.pushFirst(ctx, descs); done || err != nil {
			return err
		}
	}
	// Nothing is owed past here, but answers to notices still on their
	// way; a long batch starts with none, so that its window is its own.
	if err := t.begin(ctx, countSlices(descs) > maxOwed); err != nil {
		return err
	}
	defer t.abortOn(ctx)()
	t.deadline(ctx)
	return t.sendWrites(ctx, descs, base, marked)
}

// PostNotice sends a completion notice on the data connection, after the
// writes it announces, and leaves its reply owed: the chunk's fence (or the
// next call) reads it, so it costs no round trip of its own; or, where
// the writes were all the sender's own on one host, puts it in the
// connection's notice ring, unanswered (postRinged). With
// fenceFollows it stays buffered for that fence to send: writes, notice
// and fence then go in one segment and are answered once.
func (t *conn) PostNotice(ctx context.Context, body []byte, fenceFollows bool) error {
	if t.postRinged(body) {
		return nil
	}
	defer t.abortOn(ctx)()
	t.deadline(ctx)
	if len(t.owed) >= maxOwed {
		if err := t.readOwed(ctx); err != nil {
			return err
		}
	}
	if err := t.send(wire.Header{Op: wire.OpNotice, Len: uint64(len(body))}, body); err != nil {
		return err
	}
	t.owed = append(t.owed, owedAck{id: t.nextID, op: wire.OpNotice, notice: wire.NoticeID(body)})
	if fenceFollows {
		return nil
	}
	if err := t.w.Flush(); err != nil { // the receiver may sync on it before this sender's next call
		return ioErr("send", err)
	}
	return nil
}

// maxUnansweredNotices bounds the notices whose answers a sender leaves
// unread (a same-host fence does not wait for them): past it, the next
// call waits for them.
const maxUnansweredNotices = 64

// SettleNotices reads the answers to notices earlier calls left owed, as
// far as they arrived (all of them past maxUnansweredNotices), and
// returns the first refusal among those read since it was last called.
func (t *conn) SettleNotices(ctx context.Context) error {
	if err := t.ringRefusal(); err != nil {
		return err
	}
	if len(t.owed) == 0 { // the common case over the socket: the fence read them
		err := t.refused
		t.refused = nil
		return err
	}
	if len(t.owed) >= maxUnansweredNotices {
		if err := t.readOwed(ctx); err != nil && t.refused == nil {
			t.refused = err
		}
	} else if err := t.takeArrived(ctx); err != nil {
		return err
	}
	err := t.refused
	t.refused = nil
	return err
}

// begin reads what earlier posts left owed (answers to notices only as
// far as they arrived, unless whole) and takes pushed quiesce marks
// before new writes.
func (t *conn) begin(ctx context.Context, whole bool) error {
	if whole || slices.ContainsFunc(t.owed, notNotice) {
		if err := t.readOwed(ctx); err != nil {
			return err
		}
	}
	return t.catchUp(ctx)
}

// notNotice: an owed frame that is not a notice.
func notNotice(o owedAck) bool { return o.op != wire.OpNotice }

// takeArrived reads, without waiting for more, the frames the target has
// sent between requests: pushed quiesce marks, and answers to notices
// left owed. A refusal among them is kept for SettleNotices. It looks at
// the socket once (a peek, then one read takes all that arrived), not
// again after each frame.
func (t *conn) takeArrived(ctx context.Context) error {
	if !t.unread() {
		return nil
	}
	for {
		t.deadline(ctx)
		b, err := t.r.Peek(wire.HeaderSize)
		if err != nil {
			return ioErr("receive", err)
		}
		h, err := wire.Decode(b)
		if err != nil {
			return fmt.Errorf("%w: bad frame from target: %v", errs.Peer, err)
		}
		switch {
		case h.Op == wire.OpMark:
			t.r.Discard(wire.HeaderSize)
			t.mark = max(t.mark, h.Addr)
		case len(t.owed) == 0 || t.owed[0].op != wire.OpNotice:
			return fmt.Errorf("%w: the target sent an unasked frame (op %#x)", errs.Peer, byte(h.Op))
		default:
			o := t.owed[0]
			rep, err := t.recv(o.op, o.id)
			if err != nil {
				return err
			}
			t.owed = append(t.owed[:0], t.owed[1:]...)
			if r := t.judge(o, rep); r != nil && t.refused == nil {
				t.refused = r
			}
		}
		if t.r.Buffered() == 0 {
			return nil
		}
	}
}

// readOwed sends what is buffered (a notice posted last may not be sent
// yet) and reads the replies owed to posted frames.
func (t *conn) readOwed(ctx context.Context) error {
	if len(t.owed) == 0 {
		return nil
	}
	defer t.abortOn(ctx)()
	t.deadline(ctx)
	if err := t.w.Flush(); err != nil {
		return ioErr("send", err)
	}
	return firstErr(t.collectOwed())
}

// sendWrites sends descs' slices, recording each slice's
// acknowledgement in t.owed. Descriptors that continue one another go as
// one write (transport.Cursor, joinReach), except marked ones: the target
// digests each marked descriptor as it lands, so each keeps its own frame.
// On the same host a host-memory source goes as its address
// (OpWriteFrom) and a device-memory one as its CUDA IPC reference
// (OpWriteFromDevice), pinned until its acknowledgement is read.
// Once maxOwed are owed, it reads the older half before sending more
// (settleWindow): a long batch cannot fill both socket buffers and stall,
// and needs no second goroutine to read its answers.
func (t *conn) sendWrites(ctx context.Context, descs []desc.Desc, base int, marked bool) error {
	t.unfenced = true
	batched := t.batches(descs)
	if batched {
		defer t.dropBatch()
	}
	frames := transport.Cursor{Descs: descs, Reach: t.reach}
	if marked {
		frames.Reach = nil
	}
	for sl, more := frames.Next(); more; sl, more = frames.Next() {
		sl.CountJoined(t.joined)
		var m wire.Status
		if marked {
			m = mark(descs[sl.Desc].Len, sl.Dst == descs[sl.Desc].Dst)
		}
		if batched {
			queued, err := t.queueWrite(sl, m)
			if err != nil {
				return err
			}
			if queued {
				t.owed = append(t.owed, owedAck{id: t.nextID, op: wire.OpWrite, desc: base + sl.Desc, joined: sl.Joined})
				if len(t.batch.bufs) == 0 { // a writev went out: the next gets the full time (not reset per frame: each change costs)
					t.renew(ctx)
				}
				if err := t.settleWindow(ctx); err != nil {
					return err
				}
				continue
			}
		}
		release, ipc, err := t.sendSlice(sl, m)
		if err != nil {
			return err
		}
		t.owed = append(t.owed, owedAck{id: t.nextID, op: wire.OpWrite, desc: base + sl.Desc, joined: sl.Joined, release: release, ipc: ipc})
		t.renew(ctx)
		if err := t.settleWindow(ctx); err != nil {
			return err
		}
	}
	if batched {
		return t.flushBatch()
	}
	return nil
}

// settleWindow, once maxOwed acknowledgements are owed, sends what is
// queued and reads the older half of them. On a refusal it reads the rest
// too, so that the stream is in step and nothing of this batch is left
// owed, and returns it: the batch has failed, sending on would be waste.
func (t *conn) settleWindow(ctx context.Context) error {
	if len(t.owed) < maxOwed {
		return nil
	}
	if err := t.writeBatch(); err != nil {
		return err
	}
	if err := t.w.Flush(); err != nil {
		return ioErr("send", err)
	}
	t.deadline(ctx)
	refused, err := t.collectFirst(maxOwed / 2)
	if err != nil {
		return err
	}
	if refused != nil {
		_, err = t.collectOwed()
		return firstErr(refused, err)
	}
	return nil
}

// sendSlice sends one slice, marked with m: its bytes, or on the same
// host where it is in this process's memory. release (if not nil) unpins
// the source once the target answered.
func (t *conn) sendSlice(sl transport.Slice, m wire.Status) (release func(), ipc bool, err error) {
	if t.pull {
		rel, mem, err := t.local.Pin(sl.Src, sl.Len, t.cut)
		if err != nil {
			return nil, false, err
		}
		if !mem.Device {
			var ref [16]byte
			binary.LittleEndian.PutUint64(ref[:], sl.Src)
			binary.LittleEndian.PutUint64(ref[8:], sl.Len)
			if err := t.send(wire.Header{Op: wire.OpWriteFrom, Status: m, Addr: sl.Dst, Len: uint64(len(ref))}, ref[:]); err != nil {
				rel()
				return nil, false, err
			}
			return rel, false, nil
		}
		sent, err := t.sendDevice(sl, mem, m)
		if sent && err == nil {
			return rel, true, nil
		}
		rel() // staged below, or failed
		if err != nil {
			return nil, false, err
		}
	}
	return nil, false, t.local.LoadAbortable(sl.Src, sl.Len, t.cut, func(src []byte) error {
		return t.send(wire.Header{Op: wire.OpWrite, Status: m, Addr: sl.Dst, Len: sl.Len}, src)
	})
}

// countSlices is how many frames descs take.
func countSlices(descs []desc.Desc) int {
	n := 0
	for _, d := range descs {
		n += int((d.Len + transport.MaxSlice - 1) / transport.MaxSlice)
	}
	return n
}
