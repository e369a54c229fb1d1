// Package errs holds the sentinel errors of the whole library. Every error
// a guard returns wraps exactly one of them, and the C layer maps each to a
// status code with errors.Is. It is a leaf: every other package may use it.
package errs

import "errors"

var (
	// InvalidArg: a null, empty, wrapping or out-of-range argument.
	InvalidArg = errors.New("invalid argument")
	// Config: a bad setting, or a listener that cannot be opened.
	Config = errors.New("invalid configuration")
	// NotRegistered: an address range outside registered memory.
	NotRegistered = errors.New("address range not in registered memory")
	// Session: a peer refused or broke the handshake.
	Session = errors.New("session unusable")
	// Timeout: a peer did not answer within its deadline.
	Timeout = errors.New("deadline exceeded")
	// Peer: the connection to a peer failed or the peer sent nonsense.
	Peer = errors.New("peer error")
	// Verify: bytes did not match at the target after every retry.
	Verify = errors.New("verification failed")
	// Closed: the guard was closed while the call was in flight.
	Closed = errors.New("guard closed")
	// Device: a GPU copy or synchronisation failed, or device memory was
	// asked for where there is no usable CUDA driver.
	Device = errors.New("device memory error")
	// Quiesced: the receiver quiesced a destination range after the write
	// was sent, and refused it.
	Quiesced = errors.New("destination quiesced by the receiver")
	// Cancelled: the caller cancelled the transfer.
	Cancelled = errors.New("transfer cancelled")
	// NoMemory: the system refused memory for an allocation.
	NoMemory = errors.New("out of memory")
	// Seal: a seal that is malformed, truncated, forged, from another
	// producer, or not for the ranges read.
	Seal = errors.New("seal refused")
)
