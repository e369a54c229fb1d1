// Package core is the guard: lifecycle and registration (guard.go,
// register.go), the sender (send.go, read.go), the receiver (receive.go),
// the handshake (handshake.go) over the ZeroMQ control channel
// (control.go), sessions, notices and authentication. The data planes live
// behind one interface in core/transport. Its errors are core/errs's
// sentinels, wrapped: check them with errors.Is.
package core
