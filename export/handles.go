package main

import (
	"errors"
	"fmt"
	"sync"
	"syscall"

	"github.com/mcguard/mcguard/core"
)

var errBadHandle = errors.New("bad handle")

// handleTable maps the integer handles C holds to guards; C never holds a
// Go pointer. Handles are never reused, so a stale one cannot reach a new
// guard.
type handleTable struct {
	mu     sync.Mutex
	next   uint64
	guards map[uint64]*core.Guard
}

var handles = &handleTable{guards: map[uint64]*core.Guard{}}

func (t *handleTable) add(g *core.Guard) uint64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.next++
	t.guards[t.next] = g
	return t.next
}

func (t *handleTable) get(h uint64) (*core.Guard, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if g, ok := t.guards[h]; ok {
		return g, nil
	}
	return nil, t.badLocked(h)
}

func (t *handleTable) remove(h uint64) (*core.Guard, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	g, ok := t.guards[h]
	if !ok {
		return nil, t.badLocked(h)
	}
	delete(t.guards, h)
	lastErrors.forget(h)
	return g, nil
}

func (t *handleTable) badLocked(h uint64) error {
	if h != 0 && h <= t.next {
		return fmt.Errorf("%w: guard %d is closed", errBadHandle, h)
	}
	return fmt.Errorf("%w: %d is not a guard handle", errBadHandle, h)
}

// errorTable keeps the last error message per (handle, OS thread), like
// errno: a cgo call runs on the caller's thread, so the thread id tells
// concurrent callers apart.
type errorTable struct {
	mu   sync.Mutex
	msgs map[errorKey]string
}

type errorKey struct {
	handle uint64
	tid    int
}

// maxErrorEntries bounds the table against callers that spray bogus handles.
const maxErrorEntries = 1 << 14

var lastErrors = &errorTable{msgs: map[errorKey]string{}}

func (t *errorTable) set(h uint64, msg string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if len(t.msgs) >= maxErrorEntries {
		clear(t.msgs)
	}
	t.msgs[errorKey{h, syscall.Gettid()}] = msg
}

func (t *errorTable) get(h uint64) string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.msgs[errorKey{h, syscall.Gettid()}]
}

// forget drops a closed handle's messages, except the caller's own.
func (t *errorTable) forget(h uint64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	tid := syscall.Gettid()
	for k := range t.msgs {
		if k.handle == h && k.tid != tid {
			delete(t.msgs, k)
		}
	}
}
