// The application's engine as a guard's data plane: its C callbacks
// wrapped as core's engine.Ops.

package main

/*
#cgo CFLAGS: -I${SRCDIR}/../include
#include "mcguard.h"
#include "mcguard_internal.h"
#include <stdlib.h>
*/
import "C"

import (
	"bytes"
	"fmt"
	"unsafe"

	"github.com/mcguard/mcguard/core"
	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/core/transport/engine"
)

// callbackMsgLen is the message buffer a failing callback may fill.
const callbackMsgLen = 512

// engineOps wraps ops, called with ctx (the application's, kept as given).
func engineOps(ops *C.mc_transport_ops, ctx unsafe.Pointer) engine.Ops {
	c := *ops // the caller may free its struct after open
	out := engine.Ops{}
	if c.name != nil {
		out.Name = C.GoString(c.name)
	}
	batch := func(fn C.mc_transport_batch_fn, what string) engine.Batch {
		return func(session string, local, remote, n []uint64) error {
			cs := C.CString(session)
			defer C.free(unsafe.Pointer(cs))
			msg := make([]byte, callbackMsgLen)
			st := C.mcg_call_batch(fn, ctx, cs, (*C.uint64_t)(unsafe.Pointer(&local[0])),
				(*C.uint64_t)(unsafe.Pointer(&remote[0])), (*C.uint64_t)(unsafe.Pointer(&n[0])), C.size_t(len(n)),
				(*C.char)(unsafe.Pointer(&msg[0])), C.size_t(len(msg)))
			return callbackError(st, msg, fmt.Sprintf("%s of %d range(s) to %s", what, len(n), session))
		}
	}
	if c.write != nil {
		out.Write = batch(c.write, "write")
	}
	if c.read != nil {
		out.Read = batch(c.read, "read")
	}
	if c.register_memory != nil {
		out.Register = func(addr, n uint64) error {
			msg := make([]byte, callbackMsgLen)
			st := C.mcg_call_register(c.register_memory, ctx, C.uint64_t(addr), C.uint64_t(n), (*C.char)(unsafe.Pointer(&msg[0])), C.size_t(len(msg)))
			return callbackError(st, msg, "register_memory")
		}
	}
	if c.unregister_memory != nil {
		out.Unregister = func(addr uint64) error {
			msg := make([]byte, callbackMsgLen)
			st := C.mcg_call_unregister(c.unregister_memory, ctx, C.uint64_t(addr), (*C.char)(unsafe.Pointer(&msg[0])), C.size_t(len(msg)))
			return callbackError(st, msg, "unregister_memory")
		}
	}
	if c.fence != nil {
		out.Fence = func(session string) error {
			cs := C.CString(session)
			defer C.free(unsafe.Pointer(cs))
			msg := make([]byte, callbackMsgLen)
			st := C.mcg_call_fence(c.fence, ctx, cs, (*C.char)(unsafe.Pointer(&msg[0])), C.size_t(len(msg)))
			return callbackError(st, msg, "fence to "+session)
		}
	}
	return out
}

// callbackError is nil for MC_OK, else the error the status stands for
// with the callback's message (up to its NUL, or the buffer's end).
func callbackError(st C.mc_status, msg []byte, what string) error {
	if st == C.MC_OK {
		return nil
	}
	if i := bytes.IndexByte(msg, 0); i >= 0 {
		msg = msg[:i]
	}
	text := string(msg)
	if text == "" {
		text = "no message"
	}
	return fmt.Errorf("%w: the engine's %s failed with status %d: %s", errorOf(st), what, int32(st), text)
}

//export mcgOpenWithTransport
func mcgOpenWithTransport(configJSON *C.char, ops *C.mc_transport_ops, ctx unsafe.Pointer, out *C.mc_guard_t) (st C.mc_status) {
	defer recoverInto(&st, 0, "mc_guard_open_with_transport")
	switch {
	case out == nil:
		return fail(0, fmt.Errorf("%w: out is NULL", errs.InvalidArg))
	case ops == nil:
		return fail(0, fmt.Errorf("%w: ops is NULL", errs.InvalidArg))
	case uintptr(ops.struct_size) < unsafe.Sizeof(*ops):
		return fail(0, fmt.Errorf("%w: ops->struct_size is %d, want sizeof(mc_transport_ops) = %d", errs.InvalidArg, ops.struct_size, unsafe.Sizeof(*ops)))
	case ops.write == nil || ops.read == nil:
		return fail(0, fmt.Errorf("%w: ops->write and ops->read are required", errs.InvalidArg))
	}
	eng := engineOps(ops, ctx)
	return openGuard(configJSON, out, func(cfg core.Config) (*core.Guard, error) { return core.OpenWithEngine(cfg, eng) })
}

//export mcgSetPeerGuard
func mcgSetPeerGuard(h C.mc_guard_t, session, endpoint *C.char) C.mc_status {
	return run(h, "mc_guard_set_peer_guard", func(g *core.Guard) error {
		if session == nil || endpoint == nil {
			return fmt.Errorf("%w: session and endpoint must not be NULL", errs.InvalidArg)
		}
		return g.SetPeerGuard(C.GoString(session), C.GoString(endpoint))
	})
}
