package tcp

import (
	"context"

	"github.com/mcguard/mcguard/core/wire"
)

// The sender's side of quiesce: the generations it echoes to the target,
// and a transfer's writes kept under the generation it began in
// (transport.TransferBound). The target's side is quiesce.go.

// catchUp takes the quiesce marks the target pushed while the connection
// was idle, and echoes the newest before any new write: from the echo on,
// the target knows this sender's writes were sent after those quiesces.
// Within a transfer it echoes the transfer's generation, never a newer
// one: a transfer that began before a quiesce was sent before it, all of
// it.
func (t *conn) catchUp(ctx context.Context) error {
	if err := t.takeArrived(ctx); err != nil {
		return err
	}
	want := t.mark
	if t.within {
		want = t.epoch
	}
	if want <= t.echoed {
		return nil
	}
	defer t.abortOn(ctx)()
	if _, err := t.requestAt(ctx, wire.OpMark, want, nil); err != nil {
		return err
	}
	t.echoed = want
	return nil
}

// BeginTransfer puts the writes until EndTransfer under the quiesces
// this connection knows of now (transport.TransferBound): over the
// socket, the marks that arrived, echoed now; writing into the receiver
// itself, the lease's quiesce word, echoed before any write goes through
// the socket (no look at the socket for it).
func (t *conn) BeginTransfer(ctx context.Context) error {
	t.within = false
	if t.lease != nil {
		t.epoch = max(t.echoed, t.lease.Quiesce())
	} else {
		if err := t.catchUp(ctx); err != nil {
			return err
		}
		t.epoch = t.echoed
	}
	t.within = true
	t.pushWithin(true)
	return nil
}

// EndTransfer lets the next writes take the marks as they come.
func (t *conn) EndTransfer() {
	t.within = false
	t.pushWithin(false)
}

// Epoch is the quiesce generation the transfer's writes go under.
func (t *conn) Epoch() uint64 { return t.epoch }

// Continue carries on a transfer that began under generation epoch on
// this connection, opened since (a reconnect within the transfer): its
// hello said the newer generation of its handshake, so the target is told
// to take it down to epoch.
func (t *conn) Continue(ctx context.Context, epoch uint64) error {
	t.within, t.epoch = true, epoch
	t.pushWithin(true)
	if t.echoed <= epoch {
		return nil // the next catchUp echoes epoch
	}
	defer t.abortOn(ctx)()
	t.deadline(ctx)
	if err := t.send(wire.Header{Op: wire.OpMark, Status: wire.MarkLower, Addr: epoch}, nil); err != nil {
		return err
	}
	if err := t.w.Flush(); err != nil {
		return ioErr("send", err)
	}
	if _, err := t.owedThen(wire.OpMark, t.nextID); err != nil {
		return err
	}
	t.echoed = epoch
	return nil
}

// pushWithin tells the lease's writer whether a transfer is under way,
// and its generation.
func (t *conn) pushWithin(within bool) {
	if t.lease != nil {
		t.lease.Within(within, t.epoch)
	}
}
