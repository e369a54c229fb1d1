package tcp

import (
	"bufio"
	"context"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"syscall"
	"time"

	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/core/memory"
	"github.com/mcguard/mcguard/core/transport"
	"github.com/mcguard/mcguard/core/wire"
	"github.com/mcguard/mcguard/verify"
)

// conn is one reused data connection to a target. It is used only under
// its session's lock.
type conn struct {
	c     net.Conn
	cut   func()          // closes c: unregistering a source mid-write cuts the transfer off
	local *memory.Regions // the sources
	// finalFence: the target said its fence answers after every earlier
	// write is applied.
	finalFence bool
	// mark is the newest quiesce generation the target pushed; echoed, the
	// newest one echoed back (writes after the echo are taken).
	mark, echoed uint64
	r            *bufio.Reader
	w            *bufio.Writer
	timeout      time.Duration
	until        time.Time // the deadline set last, for the poll reader
	nextID       uint64
	hdr          [wire.HeaderSize]byte
	// owed are the posted writes whose acknowledgements are not read yet:
	// the next request reads them first, in the same flight.
	owed []owedAck
	// pull: the target copies host-memory sources out of this process
	// (same host), so writes carry addresses instead of bytes.
	pull bool
}

// owedAck is a posted frame: its id, its op, and for a write its
// descriptor (for messages).
type owedAck struct {
	id   uint64
	op   wire.Op
	desc int
	// release lets go of a pulled write's source once the target
	// answered: until then it must stay registered.
	release func()
}

// maxOwed bounds the acknowledgements left unread while more frames go
// out: a few dozen bytes each, so far below what the socket buffers hold
// and the target can never block writing them while we still send.
const maxOwed = 1024

func dial(ctx context.Context, addr string, peer transport.Peer, gen uint64, timeout time.Duration, local *memory.Regions) (*conn, error) {
	d := net.Dialer{Timeout: timeout}
	c, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("%w: data connection to %s: %v", errs.Peer, addr, err)
	}
	if tc, ok := c.(*net.TCPConn); ok {
		tc.SetNoDelay(true)
	}
	t := &conn{c: c, cut: func() { c.Close() }, local: local, w: bufio.NewWriterSize(c, 256<<10), timeout: timeout,
		mark: gen, echoed: gen}
	var src io.Reader = c
	if pr, err := readerOf(c, &t.until); err == nil {
		src = pr
	}
	t.r = bufio.NewReaderSize(src, 256<<10)
	if err := t.hello(ctx, peer); err != nil {
		t.Close()
		return nil, err
	}
	return t, nil
}

// Close aborts the connection (RST): bytes still queued for a peer we gave
// up on must not arrive later and overwrite a newer transfer's.
func (t *conn) Close() {
	if tc, ok := t.c.(*net.TCPConn); ok {
		tc.SetLinger(0)
	}
	t.c.Close()
	for _, o := range t.owed {
		if o.release != nil {
			o.release()
		}
	}
	t.owed = nil
}

// abortOn closes the connection if ctx ends (the guard is closing) while
// an operation waits on it; call the returned stop when the operation ends.
func (t *conn) abortOn(ctx context.Context) (stop func() bool) {
	return context.AfterFunc(ctx, func() { t.c.Close() })
}

func (t *conn) deadline(ctx context.Context) {
	d := time.Now().Add(t.timeout)
	if cd, ok := ctx.Deadline(); ok && cd.Before(d) {
		d = cd
	}
	t.until = d
	t.c.SetDeadline(d)
}

func (t *conn) send(h wire.Header, payload []byte) error {
	t.nextID++
	h.ID = t.nextID
	h.Encode(t.hdr[:])
	if _, err := t.w.Write(t.hdr[:]); err != nil {
		return ioErr("send", err)
	}
	if _, err := t.w.Write(payload); err != nil {
		return ioErr("send", err)
	}
	return nil
}

// recv reads one reply and checks it answers the request with id and op.
func (t *conn) recv(op wire.Op, id uint64) (wire.Header, error) {
	var hdr [wire.HeaderSize]byte
	var h wire.Header
	for {
		if _, err := io.ReadFull(t.r, hdr[:]); err != nil {
			return wire.Header{}, ioErr("receive", err)
		}
		var err error
		if h, err = wire.Decode(hdr[:]); err != nil {
			return wire.Header{}, fmt.Errorf("%w: bad reply from target: %v", errs.Peer, err)
		}
		if h.Op != wire.OpMark {
			break
		}
		t.mark = max(t.mark, h.Addr) // a quiesce at the receiver: echoed before the next writes
	}
	pulled := op == wire.OpWrite && h.Op == wire.OpWriteFrom|wire.Reply // a write is either kind
	if (h.Op != op|wire.Reply && !pulled) || h.ID != id {
		return wire.Header{}, fmt.Errorf("%w: reply out of step (op %#x id %d, want op %#x id %d)", errs.Peer, byte(h.Op), h.ID, byte(op|wire.Reply), id)
	}
	return h, nil
}

// collectOwed reads the replies of posted frames, which come before any
// later reply. It returns an I/O error (the stream is lost), or the first
// refusal among them (the stream is in step: the caller reads on).
func (t *conn) collectOwed() (refused, ioErr error) {
	owed := t.owed
	t.owed = t.owed[:0]
	defer func() { // a source the target has answered for (or never will) is free
		for _, o := range owed {
			if o.release != nil {
				o.release()
			}
		}
	}()
	for _, o := range owed {
		h, err := t.recv(o.op, o.id)
		if err != nil {
			return nil, err
		}
		switch {
		case h.Status == wire.StatusOK || refused != nil:
		case h.Status == wire.StatusStaleToken:
			refused = fmt.Errorf("%w: %w", errs.Session, transport.ErrStaleToken)
		case o.op == wire.OpNotice:
			refused = fmt.Errorf("%w: the receiver refused the completion notice (%v); its log says why", errs.Session, h.Status)
		default:
			refused = fmt.Errorf("%w: target refused descriptor %d at %#x: %v", statusErr(h.Status), o.desc, h.Addr, h.Status)
		}
	}
	return refused, nil
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

// request sends one frame and waits for its reply.
func (t *conn) request(ctx context.Context, op wire.Op, payload []byte) (wire.Header, error) {
	return t.requestAt(ctx, op, 0, payload)
}

// requestAt is request with the frame's Addr.
func (t *conn) requestAt(ctx context.Context, op wire.Op, addr uint64, payload []byte) (wire.Header, error) {
	t.deadline(ctx)
	if err := t.send(wire.Header{Op: op, Addr: addr, Len: uint64(len(payload))}, payload); err != nil {
		return wire.Header{}, err
	}
	if err := t.w.Flush(); err != nil {
		return wire.Header{}, ioErr("send", err)
	}
	return t.owedThen(op, t.nextID)
}

// fencedRequest sends a Read after the unanswered Fence fenceID and waits
// for both replies.
func (t *conn) fencedRequest(ctx context.Context, fenceID uint64, payload []byte) (wire.Header, error) {
	if err := t.send(wire.Header{Op: wire.OpRead, Len: uint64(len(payload))}, payload); err != nil {
		return wire.Header{}, err
	}
	if err := t.w.Flush(); err != nil {
		return wire.Header{}, ioErr("send", err)
	}
	f, refused := t.owedThen(wire.OpFence, fenceID)
	if refused != nil {
		// A refused write: the read's reply still comes; the caller drops
		// the connection anyway (the error is not a mismatch).
		return wire.Header{}, refused
	}
	if f.Status != wire.StatusOK {
		return wire.Header{}, fmt.Errorf("%w: target failed the fence: %v", errs.Peer, f.Status)
	}
	return t.recv(wire.OpRead, t.nextID)
}

// FenceIsFinal is what the target said of its fence.
func (t *conn) FenceIsFinal() bool { return t.finalFence }

// Refresh has nothing to take: a TCP target checks every write itself.
func (t *conn) Refresh([]byte, []memory.Region) error { return nil }

// hello answers the target's challenge: the token, and the proof over
// the challenge that the sender holds the handshake's key.
func (t *conn) hello(ctx context.Context, peer transport.Peer) error {
	t.deadline(ctx)
	var hdr [wire.HeaderSize]byte
	if _, err := io.ReadFull(t.r, hdr[:]); err != nil {
		return ioErr("receive the challenge", err)
	}
	h, err := wire.Decode(hdr[:])
	if err != nil || h.Op != wire.OpChallenge || h.Len != wire.ChallengeSize {
		return fmt.Errorf("%w: the target sent no challenge (%v)", errs.Peer, err)
	}
	challenge := make([]byte, wire.ChallengeSize)
	if _, err := io.ReadFull(t.r, challenge); err != nil {
		return ioErr("receive the challenge", err)
	}
	payload := append(append(make([]byte, 0, wire.HelloSize), peer.Token...), transport.ConnectionProof(peer.Key, challenge)...)
	rep, err := t.requestAt(ctx, wire.OpHello, t.mark, payload)
	if err != nil {
		return err
	}
	if rep.Status != wire.StatusOK {
		return fmt.Errorf("%w: target refused the data connection: %v", errs.Peer, rep.Status)
	}
	return nil
}

// Write sends every descriptor, sliced, pipelined, and collects one
// acknowledgement per slice. A batch of at most maxOwed slices is sent
// whole and then acknowledged, on this goroutine; a longer one has its
// replies read while the writes go out, so it cannot fill both socket
// buffers and stall.
func (t *conn) Write(ctx context.Context, descs []verify.Desc, base int) error {
	if countSlices(descs) > maxOwed {
		if err := t.begin(ctx); err != nil {
			return err
		}
		return t.writeLong(ctx, descs, base)
	}
	if err := t.Post(ctx, descs, base); err != nil {
		return err
	}
	defer t.abortOn(ctx)()
	t.deadline(ctx)
	return firstErr(t.collectOwed())
}

// writeLong sends a batch of more than maxOwed slices while another
// goroutine reads their acknowledgements.
func (t *conn) writeLong(ctx context.Context, descs []verify.Desc, base int) error {
	var slices []int // the descriptor of each slice, for messages
	for sl := range transport.Slices(descs) {
		slices = append(slices, base+sl.Desc)
	}
	defer t.abortOn(ctx)()
	t.deadline(ctx)
	firstID := t.nextID + 1
	acks := make(chan error, 1)
	go func() {
		var refused error
		for k := range slices {
			h, err := t.recv(wire.OpWrite, firstID+uint64(k))
			if err != nil {
				t.c.Close() // unblocks the sender too
				acks <- err
				return
			}
			if h.Status != wire.StatusOK && refused == nil {
				refused = fmt.Errorf("%w: target refused descriptor %d at %#x: %v", statusErr(h.Status), slices[k], h.Addr, h.Status)
			}
		}
		acks <- refused
	}()
	var pinned []owedAck // pulled sources, held until their acknowledgements came
	defer func() {
		for _, o := range pinned {
			o.release()
		}
	}()
	sendErr := t.sendWrites(ctx, descs, &pinned, 0)
	if sendErr != nil {
		t.c.Close() // unblocks the reply reader
		<-acks
		return sendErr
	}
	return <-acks
}

// Post sends a batch of writes and returns without reading their
// acknowledgements (verify.Poster): the next Fence or Read reads them
// first, so writes, fence and read-backs make one flight. A batch of more
// than maxOwed slices is written as Write does.
func (t *conn) Post(ctx context.Context, descs []verify.Desc, base int) error {
	if err := t.begin(ctx); err != nil { // nothing is owed past here
		return err
	}
	if countSlices(descs) > maxOwed {
		return t.writeLong(ctx, descs, base)
	}
	defer t.abortOn(ctx)()
	t.deadline(ctx)
	return t.sendWrites(ctx, descs, &t.owed, base)
}

// PostNotice sends a completion notice on the data connection, after the
// writes it announces, and leaves its reply owed: the chunk's fence (or the
// next call) reads it, so it costs no round trip of its own.
func (t *conn) PostNotice(ctx context.Context, body []byte) error {
	defer t.abortOn(ctx)()
	t.deadline(ctx)
	if len(t.owed) >= maxOwed {
		if err := t.w.Flush(); err != nil {
			return ioErr("send", err)
		}
		if err := firstErr(t.collectOwed()); err != nil {
			return err
		}
	}
	if err := t.send(wire.Header{Op: wire.OpNotice, Len: uint64(len(body))}, body); err != nil {
		return err
	}
	t.owed = append(t.owed, owedAck{id: t.nextID, op: wire.OpNotice})
	if err := t.w.Flush(); err != nil { // the receiver may sync on it before this sender's next call
		return ioErr("send", err)
	}
	return nil
}

// begin reads what earlier posts left owed and takes pushed quiesce marks
// before new writes.
func (t *conn) begin(ctx context.Context) error {
	if len(t.owed) > 0 {
		defer t.abortOn(ctx)()
		t.deadline(ctx)
		if err := t.w.Flush(); err != nil { // a notice posted last may not be sent yet
			return ioErr("send", err)
		}
		if err := firstErr(t.collectOwed()); err != nil {
			return err
		}
	}
	return t.catchUp(ctx)
}

// sendWrites sends descs' slices and flushes, recording each slice's
// acknowledgement in owed. On the same host a host-memory source goes as
// its address (OpWriteFrom), pinned until its acknowledgement is read.
func (t *conn) sendWrites(ctx context.Context, descs []verify.Desc, owed *[]owedAck, base int) error {
	var ref [16]byte
	for sl := range transport.Slices(descs) {
		var release func()
		if t.pull {
			rel, device, err := t.local.Pin(sl.Src, sl.Len, t.cut)
			if err != nil {
				return err
			}
			if device { // a GPU source is staged and sent as bytes
				rel()
			} else {
				release = rel
			}
		}
		var err error
		if release != nil {
			binary.LittleEndian.PutUint64(ref[:], sl.Src)
			binary.LittleEndian.PutUint64(ref[8:], sl.Len)
			err = t.send(wire.Header{Op: wire.OpWriteFrom, Addr: sl.Dst, Len: uint64(len(ref))}, ref[:])
		} else {
			err = t.local.LoadAbortable(sl.Src, sl.Len, t.cut, func(src []byte) error {
				return t.send(wire.Header{Op: wire.OpWrite, Addr: sl.Dst, Len: sl.Len}, src)
			})
		}
		if err != nil {
			if release != nil {
				release()
			}
			return err
		}
		o := owedAck{id: t.nextID, op: wire.OpWrite, desc: base + sl.Desc, release: release}
		if owed == &t.owed || release != nil {
			*owed = append(*owed, o)
		}
		t.deadline(ctx)
	}
	if err := t.w.Flush(); err != nil {
		return ioErr("send", err)
	}
	return nil
}

// sameHost finishes a same-host connection: the target's nonce written
// where the target can read it, and the target's word that it could. As
// setting says, a failure falls back to sending bytes (logged once) or
// fails the connection.
func (t *conn) sameHost(ctx context.Context, setting string, a answer) error {
	why := a.SameHostWhy
	if a.SameHost != "" {
		why = t.prove(ctx, a.SameHost)
		if why == "" {
			t.pull = true
			return nil
		}
	} else if why == "" {
		why = "the receiver offered none"
	}
	switch {
	case setting == SameHostRequired:
		return fmt.Errorf("%w: same_host is required and cannot be used with this receiver: %s", errs.Config, why)
	case setting == SameHostAuto && why != "another host" && why != "another pid namespace":
		logFallback(why)
	}
	return nil
}

// prove has the target read the nonce back out of this process; it
// returns why that failed, or "".
func (t *conn) prove(ctx context.Context, nonceHex string) string {
	nonce, err := hex.DecodeString(nonceHex)
	if err != nil || len(nonce) == 0 {
		return "the receiver's nonce is malformed"
	}
	p, err := newProbe(nonce)
	if err != nil {
		return "no probe page: " + err.Error()
	}
	defer p.free()
	defer t.abortOn(ctx)()
	h, err := t.requestAt(ctx, wire.OpProve, p.addr(), nil)
	if err != nil {
		return err.Error()
	}
	if h.Status != wire.StatusOK {
		return errnoText(h.Len)
	}
	return ""
}

// countSlices is how many frames descs take.
func countSlices(descs []verify.Desc) int {
	n := 0
	for _, d := range descs {
		n += int((d.Len + transport.MaxSlice - 1) / transport.MaxSlice)
	}
	return n
}

// catchUp takes the quiesce marks the target pushed while the connection
// was idle, and echoes the newest before any new write: from the echo on,
// the target knows this sender's writes were sent after those quiesces.
func (t *conn) catchUp(ctx context.Context) error {
	for t.unread() {
		t.deadline(ctx)
		b, err := t.r.Peek(wire.HeaderSize)
		if err != nil {
			return ioErr("receive", err)
		}
		h, err := wire.Decode(b)
		if err != nil || h.Op != wire.OpMark {
			return fmt.Errorf("%w: the target sent an unasked frame (%v)", errs.Peer, err)
		}
		t.r.Discard(wire.HeaderSize)
		t.mark = max(t.mark, h.Addr)
	}
	if t.mark <= t.echoed {
		return nil
	}
	defer t.abortOn(ctx)()
	if _, err := t.requestAt(ctx, wire.OpMark, t.mark, nil); err != nil {
		return err
	}
	t.echoed = t.mark
	return nil
}

// unread reports, without waiting, whether bytes the target sent wait
// unread (between requests that can only be pushed marks): one
// non-blocking peek, not a read deadline, which would wait for the poller.
func (t *conn) unread() bool {
	if t.r.Buffered() > 0 {
		return true
	}
	sc, ok := t.c.(syscall.Conn)
	if !ok {
		return false
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return false
	}
	n := 0
	rc.Read(func(fd uintptr) bool {
		var b [1]byte
		n, _, _ = syscall.Recvfrom(int(fd), b[:], syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
		return true
	})
	return n > 0
}

// Fence asks the target to reply once every earlier write on this
// connection is applied.
func (t *conn) Fence(ctx context.Context) error {
	defer t.abortOn(ctx)()
	h, err := t.request(ctx, wire.OpFence, nil)
	if err != nil {
		return err
	}
	if h.Status != wire.StatusOK {
		return fmt.Errorf("%w: target failed the fence: %v", errs.Peer, h.Status)
	}
	return nil
}

// Read fetches ranges into out, one request per wire.MaxRanges ranges or
// wire.MaxPayload bytes. With fenced, a Fence frame precedes the first
// request and both replies are read after one flush: one round trip.
func (t *conn) Read(ctx context.Context, ranges []verify.Range, out []byte, fenced bool) error {
	defer t.abortOn(ctx)()
	var fenceID uint64
	if fenced {
		t.deadline(ctx)
		if err := t.send(wire.Header{Op: wire.OpFence}, nil); err != nil {
			return err
		}
		fenceID = t.nextID
	}
	return t.readRanges(ctx, ranges, out, fenceID)
}

// readRanges does Read's requests; a fenceID other than 0 is a Fence sent
// but not yet answered, whose reply comes before the first read's.
func (t *conn) readRanges(ctx context.Context, ranges []verify.Range, out []byte, fenceID uint64) error {
	payload := make([]byte, 0, 16*min(len(ranges), wire.MaxRanges))
	size := func(i int) uint64 { return ranges[i].Len }
	for start, end := range transport.Groups(len(ranges), size, wire.MaxRanges, wire.MaxPayload) {
		payload = payload[:0]
		var total uint64
		for _, r := range ranges[start:end] {
			payload = wire.AppendRange(payload, r.Addr, r.Len)
			total += r.Len
		}
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
		if h.Status != wire.StatusOK {
			return fmt.Errorf("%w: target refused a read-back: %v", statusErr(h.Status), h.Status)
		}
		if h.Len != total {
			return fmt.Errorf("%w: read-back of %d bytes answered with %d", errs.Peer, total, h.Len)
		}
		if _, err := io.ReadFull(t.r, out[:total]); err != nil {
			return ioErr("receive", err)
		}
		out = out[total:]
	}
	return nil
}

func statusErr(s wire.Status) error {
	switch s {
	case wire.StatusQuiesced:
		return errs.Quiesced
	case wire.StatusNotRegistered:
		return errs.NotRegistered
	case wire.StatusDevice:
		return errs.Device
	}
	return errs.Peer
}

func ioErr(what string, err error) error {
	if errors.Is(err, os.ErrDeadlineExceeded) {
		return fmt.Errorf("%w: %s on the data connection: %v", errs.Timeout, what, err)
	}
	return fmt.Errorf("%w: %s on the data connection: %v", errs.Peer, what, err)
}
