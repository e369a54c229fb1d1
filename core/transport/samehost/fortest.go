package samehost

import (
	"encoding/hex"
	"errors"
	"os"
	"time"

	"golang.org/x/sys/unix"
)

// NewLeasePairForTest is a target's lease and a sender's view of it, both
// in this process (pidfd_getfd of its own descriptor, as another process
// would), for a data plane's tests; close both.
func NewLeasePairForTest(timeout time.Duration) (*Lease, *LeaseHolder, error) {
	l, err := NewLease(timeout)
	if err != nil {
		return nil, nil, err
	}
	slot, epoch := l.Assign("sender", os.Getpid())
	p, why := AttachLease(os.Getpid(), l.FD(), hex.EncodeToString(l.Nonce()), slot, epoch)
	if why != "" {
		l.Close()
		return nil, nil, errors.New(why)
	}
	return l, p, nil
}

// WatchTargetForTest makes the holder take pidfd as its target process's
// (a test's stand-in for a receiver that exited).
func (p *LeaseHolder) WatchTargetForTest(pidfd int) {
	unix.Close(p.pidfd)
	p.pidfd = pidfd
}
