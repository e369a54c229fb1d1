package core

import (
	"context"
	"sync"
	"time"
)

// deadlineContext is a context with a deadline whose timer is made only
// when something first waits on Done: a sync that finds its notice and
// ranges ready then costs no timer and no allocation
// (context.WithTimeout costs three). It lives in a pooled syncCall and
// must not be used after stop.
type deadlineContext struct {
	parent   context.Context
	deadline time.Time
	mu       sync.Mutex
	ctx      context.Context // made by the first Done
	cancel   context.CancelFunc
}

var _ context.Context = (*deadlineContext)(nil)

func (d *deadlineContext) start(parent context.Context, timeout time.Duration) {
	d.parent, d.deadline = parent, time.Now().Add(timeout)
}

// stop releases the timer, if one was made.
func (d *deadlineContext) stop() {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.cancel != nil {
		d.cancel()
	}
	d.parent, d.ctx, d.cancel = nil, nil, nil
}

func (d *deadlineContext) Deadline() (time.Time, bool) { return d.deadline, true }

func (d *deadlineContext) Done() <-chan struct{} {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.ctx == nil {
		d.ctx, d.cancel = context.WithDeadline(d.parent, d.deadline)
	}
	return d.ctx.Done()
}

func (d *deadlineContext) Err() error {
	d.mu.Lock()
	ctx := d.ctx
	d.mu.Unlock()
	switch {
	case ctx != nil:
		return ctx.Err()
	case d.parent.Err() != nil:
		return d.parent.Err()
	case !time.Now().Before(d.deadline):
		return context.DeadlineExceeded
	}
	return nil
}

func (d *deadlineContext) Value(key any) any { return d.parent.Value(key) }
