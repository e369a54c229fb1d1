// Package core is the guard: lifecycle and registration (guard.go,
// register.go), the sender (send.go, read.go), the receiver (receive.go),
// the handshake (handshake.go) over the ZeroMQ control channel
// (control.go), sessions, notices and authentication. The data planes live
// behind one interface in core/transport.
package core

import "github.com/mcguard/mcguard/core/errs"

// The sentinel errors of core/errs, under the names callers of core use.
var (
	ErrInvalidArg    = errs.InvalidArg
	ErrConfig        = errs.Config
	ErrNotRegistered = errs.NotRegistered
	ErrSession       = errs.Session
	ErrTimeout       = errs.Timeout
	ErrPeer          = errs.Peer
	ErrVerify        = errs.Verify
	ErrClosed        = errs.Closed
	ErrDevice        = errs.Device
	ErrQuiesced      = errs.Quiesced
	ErrCancelled     = errs.Cancelled
	ErrNoMemory      = errs.NoMemory
)
