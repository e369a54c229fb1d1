package transport

import (
	"syscall"
	"time"
)

// SpinBackoff is busy polling's back-off, for a waiter that spins before
// its thread sleeps (a thread asleep in the kernel takes tens of µs to
// wake on a VM): two spins in a row that did not pay (nothing came, or it
// came only late in the spin) make the next 1, 2, 4 ... MaxSpinBackoff
// waits sleep at once; one that pays ends the back-off. The peer was
// idle, or the thread that would answer could not run while this one
// spun, as when another process keeps the other core busy. The zero value
// spins.
type SpinBackoff struct {
	unpaid int // spins in a row that did not pay
	skip   int // waits left that do not spin
	back   int // the skip after the next back-off (0: 1)
}

// MaxSpinBackoff bounds the waits a back-off skips: a waiter whose spins
// do not pay still tries once in that many waits.
const MaxSpinBackoff = 64

// Skipping takes one of the waits a back-off skips, if any are left.
func (s *SpinBackoff) Skipping() bool {
	if s.skip > 0 {
		s.skip--
		return true
	}
	return false
}

// Paid records whether a spin paid, and backs off after two that did not.
func (s *SpinBackoff) Paid(ok bool) {
	if ok {
		s.unpaid, s.back = 0, 0
		return
	}
	if s.unpaid++; s.unpaid >= 2 {
		back := max(s.back, 1)
		s.unpaid, s.skip, s.back = 0, back, min(2*back, MaxSpinBackoff)
	}
}

// Yield gives the calling thread's core to any other thread that wants
// it, and goes on at once where none does: a spin's turn that leaves the
// thread it waits for room to run on a small machine.
func Yield() { syscall.RawSyscall(syscall.SYS_SCHED_YIELD, 0, 0, 0) }

// SpinPays says whether a spin whose wait ended after spent of its budget
// paid: it did if the wait ended within three quarters of it.
func SpinPays(spent, budget time.Duration) bool { return spent <= budget*3/4 }
