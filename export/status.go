// How every export ends: the handle looked up, a panic turned into
// MC_ERR_INTERNAL, an error into its status and the thread's last message.

package main

/*
#cgo CFLAGS: -I${SRCDIR}/../include
#include "mcguard.h"
#include "mcguard_internal.h"
#include <stdlib.h>
*/
import "C"

import (
	"errors"
	"fmt"
	"unsafe"

	"github.com/mcguard/mcguard/core"
	"github.com/mcguard/mcguard/core/errs"
)

// run is what every export on a guard shares: recover a panic, look up
// the handle, run body, and map its error to a status and a message.
func run(h C.mc_guard_t, fn string, body func(g *core.Guard) error) (st C.mc_status) {
	defer recoverInto(&st, h, fn)
	g, err := handles.get(uint64(h))
	if err == nil {
		err = body(g)
	}
	if err != nil {
		return fail(h, err)
	}
	return C.MC_OK
}

// fail records err as this thread's last error for h and returns its status.
func fail(h C.mc_guard_t, err error) C.mc_status {
	lastErrors.set(uint64(h), "mcguard: "+err.Error())
	return statusOf(err)
}

// recoverInto turns a panic in an export into MC_ERR_INTERNAL.
func recoverInto(st *C.mc_status, h C.mc_guard_t, fn string) {
	if r := recover(); r != nil {
		lastErrors.set(uint64(h), fmt.Sprintf("mcguard: internal error in %s: %v", fn, r))
		*st = C.MC_ERR_INTERNAL
	}
}

// statuses pairs errors with their statuses, in the order statusOf tries
// them. ErrClosed comes first: a transfer cut off by close wraps both it
// and the I/O error that close caused.
var statuses = []struct {
	err error
	st  C.mc_status
}{
	{errs.Closed, C.MC_ERR_CLOSED},
	{errs.Cancelled, C.MC_ERR_CANCELLED},
	{errBadHandle, C.MC_ERR_BAD_HANDLE},
	{errBufferTooSmall, C.MC_ERR_BUFFER_TOO_SMALL},
	{errs.InvalidArg, C.MC_ERR_INVALID_ARG},
	{errs.Config, C.MC_ERR_CONFIG},
	{errs.NotRegistered, C.MC_ERR_NOT_REGISTERED},
	{errs.Device, C.MC_ERR_DEVICE},
	{errs.Verify, C.MC_ERR_VERIFY},
	{errs.Quiesced, C.MC_ERR_QUIESCED},
	{errs.Timeout, C.MC_ERR_TIMEOUT},
	{errs.Session, C.MC_ERR_SESSION},
	{errs.Peer, C.MC_ERR_PEER},
	{errs.NoMemory, C.MC_ERR_NO_MEMORY},
	{errs.Seal, C.MC_ERR_SEAL},
}

// statusOf maps an error to its status.
func statusOf(err error) C.mc_status {
	for _, e := range statuses {
		if errors.Is(err, e.err) {
			return e.st
		}
	}
	return C.MC_ERR_INTERNAL
}

// errorOf maps a status an application's callback returned to the error
// it stands for, among those a data plane can mean (MC_ERR_PEER for the
// rest: a callback must not make a transfer look verified, closed or
// cancelled).
func errorOf(st C.mc_status) error {
	switch st {
	case C.MC_ERR_INVALID_ARG, C.MC_ERR_NOT_REGISTERED, C.MC_ERR_SESSION, C.MC_ERR_TIMEOUT, C.MC_ERR_DEVICE:
		for _, e := range statuses {
			if e.st == st {
				return e.err
			}
		}
	}
	return errs.Peer
}

//export mcgLastError
func mcgLastError(h C.mc_guard_t, buf *C.char, n C.size_t) (size C.size_t) {
	defer func() {
		if recover() != nil {
			size = 0
		}
	}()
	msg := lastErrors.get(uint64(h))
	if buf != nil && n > 0 {
		k := min(len(msg), int(n)-1)
		out := unsafe.Slice((*byte)(unsafe.Pointer(buf)), int(n))
		copy(out, msg[:k])
		out[k] = 0
	}
	return C.size_t(len(msg))
}
