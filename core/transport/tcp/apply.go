package tcp

// Applying a peer's write at the target: where its bytes come from (the
// frame's payload, the sender's memory on the same host, a sender's GPU
// allocation by CUDA IPC) and how they are put in place.

import (
	"bufio"
	"errors"
	"io"

	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/core/logs"
	"github.com/mcguard/mcguard/core/memory"
	"github.com/mcguard/mcguard/core/transport"
	"github.com/mcguard/mcguard/core/wire"
)

// source is where a write's bytes come from: the frame's payload in the
// stream, or the sender's memory (same host).
type source interface {
	fill(m []byte) error // the bytes into m
	discard() error      // the bytes not taken: the stream stays in step
}

// storer is a source that copies into place itself (device to device).
type storer interface {
	store(r *memory.Regions, addr, n uint64, cut func()) error
}

// streamSource is a write frame's payload, read through the connection's
// buffer r; what r does not hold yet is read from the connection itself
// (raw) straight into place, not through the buffer: a copy less of every
// byte of a large write.
type streamSource struct {
	r   *bufio.Reader
	raw io.Reader // r's own reader
	n   uint64
}

// directMin: a rest of a payload this large is read past the buffer.
const directMin = 16 << 10

func (s streamSource) fill(m []byte) error {
	k := 0
	if b := s.r.Buffered(); b > 0 {
		k, _ = s.r.Read(m[:min(len(m), b)]) // buffered: copied, no error
	}
	from := io.Reader(s.r)
	if len(m)-k >= directMin {
		from = s.raw
	}
	_, err := io.ReadFull(from, m[k:])
	return err
}

func (s streamSource) discard() error {
	_, err := io.CopyN(io.Discard, s.r, int64(s.n))
	return err
}

// write applies a write. A range outside registered memory is refused and
// its bytes discarded, so the stream stays in step. The bytes go straight
// into the region, which stays pinned (not locked) meanwhile: a peer that
// stalls mid-payload holds up nobody else, and unregistering the region
// cuts its connection. A marked write (mark) is digested as it lands.
func (t *target) write(l *link, addr, n uint64, src source, lagged *transport.Pending, cut func(), m wire.Status) (wire.Status, error) {
	if err := t.regions.Check(addr, n); err != nil {
		return wire.StatusNotRegistered, src.discard()
	}
	if t.faults != nil {
		return t.writeFaulty(l, addr, n, src, lagged)
	}
	// In the pending set before the quiesce check: a quiesce either sees
	// this write and waits for it, or this check sees the quiesce.
	w := memory.Region{Addr: addr, Len: n}
	id := t.pending.Add(w)
	defer t.pending.Done(id)
	if t.q.refuses(l.ack.Load(), w) {
		return wire.StatusQuiesced, src.discard()
	}
	run := t.beforeStore(l, addr, n, m)
	l.applyMu.Lock()
	var err error
	if s, ok := src.(storer); ok {
		if run != nil {
			l.land.abandon() // device to device: no bytes pass through here to digest
			run = nil
		}
		err = s.store(t.regions, addr, n, cut)
	} else {
		err = t.regions.StoreAbortable(addr, n, cut, t.fillDigesting(l, run, addr, src))
	}
	l.applyMu.Unlock()
	t.afterStore(l, run, err)
	if err == nil {
		return wire.StatusOK, nil
	}
	if isPeerRead(err) {
		logs.Printf(logs.Info, "target: %v", err)
		return wire.StatusNoAccess, nil
	}
	if errors.Is(err, errs.NotRegistered) { // unregistered since the check
		return wire.StatusNotRegistered, src.discard()
	}
	if errors.Is(err, errs.Device) { // the payload was read; its copy to the GPU failed
		logs.Printf(logs.Info, "target: %v", err)
		return wire.StatusDevice, nil
	}
	return wire.StatusOK, err
}

// isPeerRead reports whether err is a failed same-host copy (a refusal,
// not a broken stream); its own function so that nothing is allocated for
// a write that succeeded.
func isPeerRead(err error) bool {
	var pe errPeerRead
	return errors.As(err, &pe)
}
