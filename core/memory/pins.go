package memory

import (
	"fmt"
	"sync"

	"github.com/mcguard/mcguard/core/cuda"
	"github.com/mcguard/mcguard/core/errs"
)

// Holding a region registered while an access runs: Remove waits for
// the holds, and cuts off those that wait on a peer.

// pins counts a region's accesses in progress, so that Remove can wait for
// them without the table's lock: an access that waits on a peer (a payload
// still arriving, a reply the peer does not read) holds its region only,
// never the table, and Remove cuts it off through its abort function.
type pins struct {
	mu      sync.Mutex
	n       int
	next    uint64
	aborts  map[uint64]func()
	removed bool
	idle    *sync.Cond // signalled when n drops to 0
}

func newPins() *pins {
	p := &pins{aborts: map[uint64]func(){}}
	p.idle = sync.NewCond(&p.mu)
	return p
}

func (p *pins) enter(abort func()) uint64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.n++
	p.next++
	if abort != nil {
		p.aborts[p.next] = abort
	}
	return p.next
}

func (p *pins) leave(id uint64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	delete(p.aborts, id)
	if p.n--; p.n == 0 {
		p.idle.Broadcast()
	}
}

// drain cuts off the accesses that can be cut and waits for all of them.
func (p *pins) drain() {
	p.mu.Lock()
	p.removed = true
	aborts := make([]func(), 0, len(p.aborts))
	for _, a := range p.aborts {
		aborts = append(aborts, a)
	}
	p.mu.Unlock()
	for _, a := range aborts {
		a()
	}
	p.mu.Lock()
	for p.n > 0 {
		p.idle.Wait()
	}
	p.mu.Unlock()
}

// within runs fn on the region holding [addr, addr+n) with the region
// pinned, so that it cannot be unregistered meanwhile; abort, if not nil,
// cuts fn short when it is (it closes the connection fn waits on).
func (t *Regions) within(addr, n uint64, abort func(), fn func(mem cuda.Memory) error) error {
	h, mem, err := t.hold(addr, n, abort)
	if err != nil {
		return err
	}
	defer h.Release()
	return fn(mem)
}

// Pin holds the region of [addr, addr+n) registered until release is
// called (Unregister waits for it; abort, if not nil, is called to cut it
// short), and says where its bytes live.
func (t *Regions) Pin(addr, n uint64, abort func()) (release func(), mem cuda.Memory, err error) {
	h, mem, err := t.hold(addr, n, abort)
	if err != nil {
		return nil, mem, err
	}
	var once sync.Once
	return func() { once.Do(h.Release) }, mem, nil
}

// Held is a region held registered by Hold: Pin without a closure, for
// hot paths that release many at once. Release it exactly once.
type Held struct {
	p  *pins
	id uint64
}

// Hold is Pin returning a Held instead of a release function.
func (t *Regions) Hold(addr, n uint64) (Held, cuda.Memory, error) { return t.hold(addr, n, nil) }

func (t *Regions) hold(addr, n uint64, abort func()) (Held, cuda.Memory, error) {
	h, _, mem, err := t.HoldRegion(addr, n, abort)
	return h, mem, err
}

// HoldRegion is Hold (abortable) that also says which region it holds,
// so that a run of ranges inside it needs one hold.
func (t *Regions) HoldRegion(addr, n uint64, abort func()) (Held, Region, cuda.Memory, error) {
	t.mu.RLock()
	r := t.findLocked(addr, n)
	if r == nil {
		t.mu.RUnlock()
		return Held{}, Region{}, cuda.Memory{}, fmt.Errorf("%w: [%#x, +%d)", errs.NotRegistered, addr, n)
	}
	p, reg, mem := r.pins, r.Region, r.mem
	id := p.enter(abort)
	t.mu.RUnlock()
	return Held{p: p, id: id}, reg, mem, nil
}

// Release lets go of a Held region.
func (h Held) Release() { h.p.leave(h.id) }
