package core

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"time"

	"github.com/mcguard/mcguard/core/wire"
	"github.com/mcguard/mcguard/verify"
)

// transport moves bytes to one session's target. write returns when the
// transport reports the writes complete; that is exactly the promise this
// library does not trust, which is why verification follows it.
type transport interface {
	write(ctx context.Context, descs []verify.Desc, base int, local *Regions) error
	// fence returns once every earlier write is applied at the target.
	fence(ctx context.Context) error
	// read fetches ranges into out; with fenced, a fence goes first, in
	// the same round trip.
	read(ctx context.Context, ranges []verify.Range, out []byte, fenced bool) error
	close()
}

// tcpConn is one reused data connection to a target. It is used only under
// its session's lock.
type tcpConn struct {
	c       net.Conn
	r       *bufio.Reader
	w       *bufio.Writer
	timeout time.Duration
	nextID  uint64
	hdr     [wire.HeaderSize]byte
}

func dialTCP(ctx context.Context, addr string, token []byte, timeout time.Duration) (*tcpConn, error) {
	d := net.Dialer{Timeout: timeout}
	c, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("%w: data connection to %s: %v", ErrPeer, addr, err)
	}
	if tc, ok := c.(*net.TCPConn); ok {
		tc.SetNoDelay(true)
	}
	t := &tcpConn{c: c, r: bufio.NewReaderSize(c, 256<<10), w: bufio.NewWriterSize(c, 256<<10), timeout: timeout}
	if err := t.hello(ctx, token); err != nil {
		t.close()
		return nil, err
	}
	return t, nil
}

// close aborts the connection (RST): bytes still queued for a peer we gave
// up on must not arrive later and overwrite a newer transfer's.
func (t *tcpConn) close() {
	if tc, ok := t.c.(*net.TCPConn); ok {
		tc.SetLinger(0)
	}
	t.c.Close()
}

// abortOn closes the connection if ctx ends (the guard is closing) while
// an operation waits on it; call the returned stop when the operation ends.
func (t *tcpConn) abortOn(ctx context.Context) (stop func() bool) {
	return context.AfterFunc(ctx, func() { t.c.Close() })
}

func (t *tcpConn) deadline(ctx context.Context) {
	d := time.Now().Add(t.timeout)
	if cd, ok := ctx.Deadline(); ok && cd.Before(d) {
		d = cd
	}
	t.c.SetDeadline(d)
}

func (t *tcpConn) send(h wire.Header, payload []byte) error {
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
func (t *tcpConn) recv(op wire.Op, id uint64) (wire.Header, error) {
	var hdr [wire.HeaderSize]byte
	if _, err := io.ReadFull(t.r, hdr[:]); err != nil {
		return wire.Header{}, ioErr("receive", err)
	}
	h, err := wire.Decode(hdr[:])
	if err != nil {
		return wire.Header{}, fmt.Errorf("%w: bad reply from target: %v", ErrPeer, err)
	}
	if h.Op != op|wire.Reply || h.ID != id {
		return wire.Header{}, fmt.Errorf("%w: reply out of step (op %#x id %d, want op %#x id %d)", ErrPeer, byte(h.Op), h.ID, byte(op|wire.Reply), id)
	}
	return h, nil
}

// request sends one frame and waits for its reply.
func (t *tcpConn) request(ctx context.Context, op wire.Op, payload []byte) (wire.Header, error) {
	t.deadline(ctx)
	if err := t.send(wire.Header{Op: op, Len: uint64(len(payload))}, payload); err != nil {
		return wire.Header{}, err
	}
	if err := t.w.Flush(); err != nil {
		return wire.Header{}, ioErr("send", err)
	}
	return t.recv(op, t.nextID)
}

// fencedRequest sends a Read after the unanswered Fence fenceID and waits
// for both replies.
func (t *tcpConn) fencedRequest(ctx context.Context, fenceID uint64, payload []byte) (wire.Header, error) {
	if err := t.send(wire.Header{Op: wire.OpRead, Len: uint64(len(payload))}, payload); err != nil {
		return wire.Header{}, err
	}
	if err := t.w.Flush(); err != nil {
		return wire.Header{}, ioErr("send", err)
	}
	f, err := t.recv(wire.OpFence, fenceID)
	if err != nil {
		return wire.Header{}, err
	}
	if f.Status != wire.StatusOK {
		return wire.Header{}, fmt.Errorf("%w: target failed the fence: %v", ErrPeer, f.Status)
	}
	return t.recv(wire.OpRead, t.nextID)
}

func (t *tcpConn) hello(ctx context.Context, token []byte) error {
	h, err := t.request(ctx, wire.OpHello, token)
	if err != nil {
		return err
	}
	if h.Status != wire.StatusOK {
		return fmt.Errorf("%w: target refused the data connection: %v", ErrPeer, h.Status)
	}
	return nil
}

// write sends every descriptor, sliced at wire.WriteSlice, pipelined, and
// collects one acknowledgement per slice. The replies are read while the
// writes go out, so a long batch cannot fill both socket buffers and stall.
func (t *tcpConn) write(ctx context.Context, descs []verify.Desc, base int, local *Regions) error {
	type slice struct{ desc int }
	var slices []slice
	for i, d := range descs {
		for off := uint64(0); off < d.Len; off += wire.WriteSlice {
			slices = append(slices, slice{base + i})
		}
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
				refused = fmt.Errorf("%w: target refused descriptor %d at %#x: %v", statusErr(h.Status), slices[k].desc, h.Addr, h.Status)
			}
		}
		acks <- refused
	}()
	var sendErr error
	for _, d := range descs {
		for off := uint64(0); off < d.Len && sendErr == nil; off += wire.WriteSlice {
			n := min(wire.WriteSlice, d.Len-off)
			sendErr = local.Load(d.Src+off, n, func(src []byte) error {
				return t.send(wire.Header{Op: wire.OpWrite, Addr: d.Dst + off, Len: n}, src)
			})
			t.deadline(ctx)
		}
	}
	if sendErr == nil {
		if err := t.w.Flush(); err != nil {
			sendErr = ioErr("send", err)
		}
	}
	if sendErr != nil {
		t.c.Close() // unblocks the reply reader
		<-acks
		return sendErr
	}
	return <-acks
}

// fence asks the target to reply once every earlier write on this
// connection is applied.
func (t *tcpConn) fence(ctx context.Context) error {
	defer t.abortOn(ctx)()
	h, err := t.request(ctx, wire.OpFence, nil)
	if err != nil {
		return err
	}
	if h.Status != wire.StatusOK {
		return fmt.Errorf("%w: target failed the fence: %v", ErrPeer, h.Status)
	}
	return nil
}

// read fetches ranges into out, one request per wire.MaxRanges ranges or
// wire.MaxPayload bytes. With fenced, a Fence frame precedes the first
// request and both replies are read after one flush: one round trip.
func (t *tcpConn) read(ctx context.Context, ranges []verify.Range, out []byte, fenced bool) error {
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

// readRanges does read's requests; a fenceID other than 0 is a Fence sent
// but not yet answered, whose reply comes before the first read's.
func (t *tcpConn) readRanges(ctx context.Context, ranges []verify.Range, out []byte, fenceID uint64) error {
	payload := make([]byte, 0, 16*min(len(ranges), wire.MaxRanges))
	for len(ranges) > 0 {
		payload = payload[:0]
		var total uint64
		k := 0
		for ; k < len(ranges) && k < wire.MaxRanges; k++ {
			if total+ranges[k].Len > wire.MaxPayload && k > 0 {
				break
			}
			payload = wire.AppendRange(payload, ranges[k].Addr, ranges[k].Len)
			total += ranges[k].Len
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
			return fmt.Errorf("%w: read-back of %d bytes answered with %d", ErrPeer, total, h.Len)
		}
		if _, err := io.ReadFull(t.r, out[:total]); err != nil {
			return ioErr("receive", err)
		}
		out, ranges = out[total:], ranges[k:]
	}
	return nil
}

func statusErr(s wire.Status) error {
	switch s {
	case wire.StatusNotRegistered:
		return ErrNotRegistered
	case wire.StatusDevice:
		return ErrDevice
	}
	return ErrPeer
}

func ioErr(what string, err error) error {
	if errors.Is(err, os.ErrDeadlineExceeded) {
		return fmt.Errorf("%w: %s on the data connection: %v", ErrTimeout, what, err)
	}
	return fmt.Errorf("%w: %s on the data connection: %v", ErrPeer, what, err)
}
