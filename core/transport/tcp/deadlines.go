package tcp

// A sender's connection and time: the deadlines its reads and writes run
// under, and closing it when the operation's context ends.

import (
	"context"
	"time"
)

// abortOn closes the connection if ctx ends (the guard is closing, the
// session's calls are cancelled, a deadline passes) while an operation
// waits on it; call the returned stop when the operation ends. A context
// without a deadline is the session's calls' (or the guard's), which ends
// only for those reasons: it is watched once for the connection's life
// instead of once per operation (no allocation per transfer). One with a
// deadline is a single call's, which ends when the call does: watched per
// operation.
func (t *conn) abortOn(ctx context.Context) (stop func() bool) {
	if _, ok := ctx.Deadline(); ok {
		return context.AfterFunc(ctx, t.cut)
	}
	if ctx != t.watched {
		if t.unwatch != nil {
			t.unwatch()
		}
		t.watched, t.unwatch = ctx, context.AfterFunc(ctx, t.cut)
	}
	return keepWatching
}

func keepWatching() bool { return false }

// deadline gives the next reads and writes the timeout from now (or
// ctx's deadline, if sooner). A deadline set less than deadlineSlack
// before is kept (kept: a timeout may end that much early): the calls of
// one transfer, and transfers back to back, come microseconds apart, and
// each change is a timer update, about a third of a µs, several times per
// 4 KiB transfer.
func (t *conn) deadline(ctx context.Context) {
	d := t.deadlineFrom(ctx)
	if t.recent(t.until, d) && t.recent(t.wuntil, d) {
		return
	}
	t.until, t.wuntil = d, d
	t.c.SetDeadline(d)
}

// recent: set, at most d, and less than deadlineSlack (an eighth of the
// timeout, if less) before it.
func (t *conn) recent(set, d time.Time) bool {
	return !set.After(d) && d.Sub(set) < min(deadlineSlack, t.timeout/8)
}

const deadlineSlack = time.Millisecond

// deadlineFrom is the timeout from now, or ctx's deadline if sooner.
func (t *conn) deadlineFrom(ctx context.Context) time.Time {
	d := time.Now().Add(t.timeout)
	if cd, ok := ctx.Deadline(); ok && cd.Before(d) {
		d = cd
	}
	return d
}

// renew gives the next write the full timeout: the write deadline only.
// Every read sets its own deadline first, and the reading side may be
// another goroutine's meanwhile (ReadPosting), polling against t.until.
func (t *conn) renew(ctx context.Context) {
	if d := t.deadlineFrom(ctx); !t.recent(t.wuntil, d) {
		t.wuntil = d
		t.c.SetWriteDeadline(d)
	}
}
