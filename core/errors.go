// Package core is the guard: sessions with one lock each, registered
// memory, chunking, the TCP transport and its target server, the ZMQ
// control channel and fault injection.
package core

import (
	"errors"

	"github.com/mcguard/mcguard/verify"
)

// Sentinel errors; every error a Guard returns wraps exactly one of them,
// and the C layer maps each to a status code with errors.Is.
var (
	ErrInvalidArg    = errors.New("invalid argument")
	ErrConfig        = verify.ErrConfig
	ErrNotRegistered = errors.New("address range not in registered memory")
	ErrSession       = errors.New("session unusable")
	ErrTimeout       = errors.New("deadline exceeded")
	ErrPeer          = errors.New("peer error")
	ErrVerify        = verify.ErrMismatch
	ErrClosed        = errors.New("guard closed")
	// ErrDevice: a GPU copy or synchronisation failed, or device memory
	// was asked for where there is no usable CUDA driver.
	ErrDevice = errors.New("device memory error")
)
