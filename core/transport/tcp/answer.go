package tcp

// The target's answers to the frames that are not writes: completion
// notices, fences and read-backs.

import (
	"context"
	"errors"
	"io"
	"sync"

	"github.com/mcguard/mcguard/core/logs"
	"github.com/mcguard/mcguard/core/memory"
	"github.com/mcguard/mcguard/core/transport"
	"github.com/mcguard/mcguard/core/wire"
)

// maxNoticeFrame bounds a notice frame: its largest chunk.
const maxNoticeFrame = wire.NoticeHeaderSize + wire.MaxNoticeDescs*wire.NoticeDescSize + wire.NoticeMACSize

// noticeKept bounds the notice buffer a link keeps between notices: a
// one-descriptor notice is 96 bytes, a 512-descriptor chunk 12 KiB.
const noticeKept = 16 << 10

// noticeBody is a buffer of n bytes for a notice's body: the link's own
// where it is small enough to keep, else one from largeNotices, which the
// caller puts back (pooled) once the guard has taken the notice: the
// guard keeps nothing of a body it was handed.
func (l *link) noticeBody(n int) (body []byte, pooled *[]byte) {
	if n > noticeKept {
		p, _ := largeNotices.Get().(*[]byte)
		if p == nil || cap(*p) < n {
			b := make([]byte, n)
			p = &b
		}
		return (*p)[:n], p
	}
	if cap(l.notice) < n {
		l.notice = make([]byte, noticeKept)
	}
	return l.notice[:n], nil
}

// largeNotices are the buffers of notices above noticeKept (chunks of
// more than about 600 descriptors), shared by the target's links: kept
// per link they would hold up to maxNoticeFrame each; a pool lets the
// garbage collector have them back when notices that large stop.
var largeNotices sync.Pool

// takeNotice hands a Notice frame's notice to the guard.
func (t *target) takeNotice(l *link, r io.Reader, n uint64) (wire.Status, error) {
	if n > maxNoticeFrame || t.notice == nil {
		_, err := io.CopyN(io.Discard, r, int64(n))
		return wire.StatusBadRequest, err
	}
	body, pooled := l.noticeBody(int(n))
	if pooled != nil {
		defer largeNotices.Put(pooled)
	}
	if _, err := io.ReadFull(r, body); err != nil {
		return 0, err
	}
	var landed transport.Landed
	if t.landed != nil {
		landed = l.land.take(t.landed)
	}
	l.ring.mu.Lock()
	t.ringNotices(l) // the ring's come first: they were sent before this one
	err := t.notice(body, landed, &l.auth)
	l.ring.mu.Unlock()
	if err != nil {
		if errors.Is(err, transport.ErrStaleToken) {
			return wire.StatusStaleToken, nil
		}
		logs.Printf(logs.Info, "target %s: completion notice refused: %v", t.addr(), err)
		return wire.StatusBadRequest, nil
	}
	return wire.StatusOK, nil
}

// fence replies once every earlier write on the connection is applied.
// Writes that a reorder fault holds are not waited for (another path).
func (t *target) fence(r io.Reader, n uint64, lagged *transport.Pending) (wire.Status, error) {
	if n != 0 {
		_, err := io.CopyN(io.Discard, r, int64(n))
		return wire.StatusBadRequest, err
	}
	if lagged.Empty() { // the common case: nothing held back
		return wire.StatusOK, nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), t.timeout)
	defer cancel()
	if err := lagged.Wait(ctx, nil); err != nil {
		return wire.StatusBadRequest, err
	}
	return wire.StatusOK, nil
}

// read decodes a Read frame's ranges and returns the reply's length and a
// function that writes the bytes, or a refusal if any range is outside
// registered memory. The ranges and the function are the link's own,
// reused frame after frame.
func (t *target) read(l *link, r io.Reader, n uint64, cut func()) (wire.Status, uint64, func(io.Writer) error, error) {
	if n > wire.MaxRanges*16 {
		_, err := io.CopyN(io.Discard, r, int64(n))
		return wire.StatusTooLarge, 0, nil, err
	}
	if uint64(cap(l.rd.raw)) < n {
		l.rd.raw = make([]byte, n)
	}
	p := l.rd.raw[:n]
	if _, err := io.ReadFull(r, p); err != nil {
		return 0, 0, nil, err
	}
	var total uint64
	var err error
	l.rd.addrs, l.rd.lens, total, err = wire.DecodeRangesInto(p, l.rd.addrs[:0], l.rd.lens[:0])
	if err != nil {
		return wire.StatusBadRequest, 0, nil, nil
	}
	if t.regions.CheckRanges(l.rd.addrs, l.rd.lens) >= 0 {
		return wire.StatusNotRegistered, 0, nil, nil
	}
	l.rd.t, l.rd.cut = t, cut
	if t.readHook != nil {
		t.readHook("arrived")
	}
	// As a write: recorded before the quiesce check, so that a quiesce of
	// the ranges (a producer handing its blocks back) either waits for
	// this read or this read sees it and is refused.
	for i, a := range l.rd.addrs {
		l.rd.pending = append(l.rd.pending, t.reads.Add(memory.Region{Addr: a, Len: l.rd.lens[i]}))
	}
	for i, a := range l.rd.addrs {
		if t.q.refuses(l.ack.Load(), memory.Region{Addr: a, Len: l.rd.lens[i]}) {
			l.rd.done()
			return wire.StatusQuiesced, 0, nil, nil
		}
	}
	if t.readHook != nil {
		t.readHook("reading")
	}
	if l.rd.send == nil {
		l.rd.send = l.rd.write // bound once
	}
	return wire.StatusOK, total, l.rd.send, nil
}

// readReply is a link's read-back being answered: the ranges of its frame.
type readReply struct {
	t            *target
	cut          func()
	raw          []byte
	addrs, lens  []uint64
	send         func(io.Writer) error // write, bound once
	pending      []uint64              // its ranges' entries in the target's reads, until answered
	w            io.Writer
	writeToReply func(m []byte) error // to, bound once
}

// write writes the ranges' bytes to w.
func (rd *readReply) write(w io.Writer) error {
	t := rd.t
	if t.faults.Holds() { // see applyMu
		t.applyMu.Lock()
		defer t.applyMu.Unlock()
	}
	rd.w = w
	defer func() { rd.w = nil }()
	if rd.writeToReply == nil {
		rd.writeToReply = rd.to
	}
	// A region unregistered after the reply header went out leaves a
	// promised length unfillable: drop the connection so the reader fails
	// rather than compares invented bytes.
	return t.regions.LoadRanges(rd.addrs, rd.lens, rd.cut, rd.writeToReply)
}

// done takes the read's ranges out of the target's reads in progress.
func (rd *readReply) done() {
	for _, id := range rd.pending {
		rd.t.reads.Done(id)
	}
	rd.pending = rd.pending[:0]
}

func (rd *readReply) to(m []byte) error {
	_, err := rd.w.Write(m)
	return err
}
