package engine

import (
	"context"
	"fmt"

	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/core/memory"
)

// A receiver over an engine cannot refuse a late write: the engine writes
// into its memory without this library. So its quiesce is kept here, at
// the sender, once the application's own channel brought it
// (QuiesceSession): no call of a transfer that began before it writes
// into the quiesced ranges, and QuiesceSession returns once no call of
// such a transfer to the session still runs. Slices an engine runs after
// its call returned stay beyond it.

// maxFencesPerSession bounds the fences a session keeps while transfers
// that began before them still run; past it the two oldest are folded
// into one under the newer epoch (stricter: it may refuse a write that
// began between them into the older one's ranges, never let one through).
const maxFencesPerSession = 1024

// fence is one quiesce: the peer's ranges, and the epoch it was taken
// under (transfers that began under an earlier one may not write there).
type fence struct {
	epoch   uint64
	regions []memory.Region
}

// sessionFences is what a session keeps for its fences: the fences, and
// the transfers and engine calls under way by the epoch their transfer
// began under (a fence is dropped once nothing of an earlier epoch is
// left).
type sessionFences struct {
	fences    []fence
	transfers map[uint64]int
	calls     map[uint64]transferCalls
}

// sessionLocked returns session's state, made on first use (p.mu held).
func (p *Plane) sessionLocked(session string) *sessionFences {
	s := p.sessions[session]
	if s == nil {
		s, p.spare = p.spare, nil
		if s == nil {
			s = &sessionFences{transfers: map[uint64]int{}, calls: map[uint64]transferCalls{}}
		}
		p.sessions[session] = s
	}
	return s
}

// startTransfer records a transfer beginning on session; it returns the
// epoch it began under, for its calls.
func (p *Plane) startTransfer(session string) uint64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.sessionLocked(session).transfers[p.epoch]++
	return p.epoch
}

// endTransfer is startTransfer's other half.
func (p *Plane) endTransfer(session string, began uint64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	s := p.sessions[session]
	if s == nil {
		return
	}
	if s.transfers[began]--; s.transfers[began] <= 0 {
		delete(s.transfers, began)
	}
	p.pruneLocked(session, s)
}

// beginCallLocked and endCallLocked count an engine call of a transfer
// that began under epoch began (p.mu held).
func (p *Plane) beginCallLocked(session string, began uint64) {
	addCall(p.sessionLocked(session).calls, began)
}

func (p *Plane) endCallLocked(session string, began uint64) {
	s := p.sessions[session]
	if s == nil {
		return
	}
	endCall(s.calls, began)
	p.pruneLocked(session, s)
}

// fencedLocked says why a write of a transfer that began under epoch
// began into remote ranges at session must not go to the engine, or nil
// (p.mu held: checked as the call is counted, so that a quiesce either
// waits for the call or the call sees the quiesce).
func (p *Plane) fencedLocked(session string, began uint64, remote, n []uint64) error {
	s := p.sessions[session]
	if s == nil {
		return nil
	}
	for _, f := range s.fences {
		if f.epoch <= began {
			continue
		}
		for i := range remote {
			for _, r := range f.regions {
				if remote[i] < r.Addr+r.Len && r.Addr < remote[i]+n[i] {
					return fmt.Errorf("%w: [%#x, +%d) at %s was quiesced by the receiver after this transfer began", errs.Quiesced, remote[i], n[i], session)
				}
			}
		}
	}
	return nil
}

// QuiesceSession keeps the receiver's quiesce of regions (its addresses)
// at session: from now on no call of a transfer that began before it
// writes there, and it returns once no engine call of such a transfer to
// the session is running, held writes included, or fails at ctx's end
// saying how many still run.
func (p *Plane) QuiesceSession(ctx context.Context, session string, regions []memory.Region) error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return fmt.Errorf("%w: the engine data plane is closed", errs.Closed)
	}
	p.epoch++
	s := p.sessionLocked(session)
	s.fences = append(s.fences, fence{epoch: p.epoch, regions: append([]memory.Region(nil), regions...)})
	if len(s.fences) > maxFencesPerSession {
		a, b := s.fences[0], s.fences[1]
		s.fences[1] = fence{epoch: b.epoch, regions: append(a.regions, b.regions...)}
		s.fences = s.fences[1:]
	}
	epoch := p.epoch
	var waits []<-chan struct{}
	for began := range s.calls {
		if began < epoch {
			waits = append(waits, waitCalls(s.calls, began))
		}
	}
	p.pruneLocked(session, s)
	p.mu.Unlock()
	for _, done := range waits {
		select {
		case <-done:
		case <-ctx.Done():
			p.mu.Lock()
			n := 0
			if s := p.sessions[session]; s != nil {
				for began, c := range s.calls {
					if began < epoch {
						n += c.n
					}
				}
			}
			p.mu.Unlock()
			return fmt.Errorf("%w: %d engine call(s) to %s that began before the quiesce still running: their bytes may still land", errs.Timeout, n, session)
		}
	}
	return nil
}

// pruneLocked drops the fences no transfer or call can be held to any
// more, and the session's state once it holds nothing (p.mu held).
func (p *Plane) pruneLocked(session string, s *sessionFences) {
	oldest := p.epoch + 1 // the earliest epoch a transfer or call under way began under
	for began := range s.transfers {
		oldest = min(oldest, began)
	}
	for began := range s.calls {
		oldest = min(oldest, began)
	}
	keep := s.fences[:0]
	for _, f := range s.fences {
		if f.epoch > oldest {
			keep = append(keep, f)
		}
	}
	clear(s.fences[len(keep):])
	s.fences = keep
	if len(s.fences) == 0 && len(s.transfers) == 0 && len(s.calls) == 0 {
		delete(p.sessions, session)
		if p.spare == nil {
			p.spare = s
		}
	}
}

// Sessions is how many sessions keep fence state: no more than those with
// fences, transfers or calls under way.
func (p *Plane) Sessions() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.sessions)
}
