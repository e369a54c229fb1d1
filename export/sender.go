// The sender's exports: transfers, reads, cancel, and what a sender asks
// of a session (its regions, a notify).

package main

/*
#cgo CFLAGS: -I${SRCDIR}/../include
#include "mcguard.h"
#include "mcguard_internal.h"
#include <stdlib.h>
*/
import "C"

import (
	"fmt"
	"time"
	"unsafe"

	"github.com/mcguard/mcguard/core"
	"github.com/mcguard/mcguard/core/desc"
	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/verify"
)

// cArray views a C array of n uint64s; n has been checked against the limit.
func cArray(p *C.uint64_t, n int) []uint64 {
	return unsafe.Slice((*uint64)(unsafe.Pointer(p)), n)
}

// verifyModes maps MC_VERIFY_* to modes, in the header's numbering.
var verifyModes = map[C.int32_t]verify.Mode{C.MC_VERIFY_OFF: verify.Off, C.MC_VERIFY_TAIL: verify.Tail,
	C.MC_VERIFY_SAMPLE: verify.Sample, C.MC_VERIFY_FULL: verify.Full, C.MC_VERIFY_DIGEST: verify.Digest}

// batchArgs checks and decodes the arguments mc_guard_transfer and
// mc_guard_read share: a session name and n (local, remote, len) triples.
func batchArgs(session *C.char, local, remote, length *C.uint64_t, n C.size_t) (string, []desc.Desc, error) {
	switch {
	case session == nil:
		return "", nil, fmt.Errorf("%w: session is NULL", errs.InvalidArg)
	case n == 0:
		return "", nil, fmt.Errorf("%w: n is 0: a batch needs at least one descriptor", errs.InvalidArg)
	case n > core.MaxDescriptors:
		return "", nil, fmt.Errorf("%w: n = %d is over MC_GUARD_MAX_DESCRIPTORS (%d)", errs.InvalidArg, uint64(n), core.MaxDescriptors)
	case local == nil || remote == nil || length == nil:
		return "", nil, fmt.Errorf("%w: the address and length arrays must not be NULL", errs.InvalidArg)
	}
	k := int(n)
	l, r, ln := cArray(local, k), cArray(remote, k), cArray(length, k)
	descs := make([]desc.Desc, k)
	for i := range descs {
		descs[i] = desc.Desc{Src: l[i], Dst: r[i], Len: ln[i]}
	}
	return C.GoString(session), descs, nil
}

//export mcgTransfer
func mcgTransfer(h C.mc_guard_t, session *C.char, src, dst, length *C.uint64_t, n C.size_t, opts *C.mc_transfer_opts) C.mc_status {
	return run(h, "mc_guard_transfer", func(g *core.Guard) error {
		name, descs, err := batchArgs(session, src, dst, length, n)
		if err != nil {
			return err
		}
		var o core.TransferOptions
		// A 0.2 caller's struct ends before deadline_ms; it is still taken.
		v02 := C.uint32_t(unsafe.Offsetof(opts.deadline_ms))
		grown := opts != nil && opts.struct_size >= C.uint32_t(unsafe.Sizeof(*opts))
		if opts != nil {
			if opts.struct_size < v02 || (opts.struct_size > v02 && !grown) {
				return fmt.Errorf("%w: opts->struct_size is %d, want sizeof(mc_transfer_opts) = %d", errs.InvalidArg, opts.struct_size, unsafe.Sizeof(*opts))
			}
			if grown {
				if opts.deadline_ms > C.uint64_t(24*time.Hour/time.Millisecond) {
					return fmt.Errorf("%w: opts->deadline_ms = %d is over a day", errs.InvalidArg, uint64(opts.deadline_ms))
				}
				o.Deadline = time.Duration(opts.deadline_ms) * time.Millisecond
			}
			if opts.verify != C.MC_VERIFY_DEFAULT {
				m, ok := verifyModes[opts.verify]
				if !ok {
					return fmt.Errorf("%w: opts->verify = %d is not an MC_VERIFY_* value", errs.InvalidArg, opts.verify)
				}
				o.Verify = &m
			}
			if opts.digests != nil {
				o.Digests = cArray(opts.digests, len(descs))
			}
			o.NoNotice = opts.flags&C.MC_TRANSFER_NO_NOTICE != 0
		}
		res, err := g.Transfer(name, descs, o)
		if grown {
			opts.abort_state = C.int32_t(res.Abort)
		}
		if opts != nil {
			opts.transfer_id = C.uint64_t(res.ID) // a failed one's too: mc_guard_wait_engine_calls takes it
		}
		if err != nil {
			return err
		}
		if opts != nil {
			opts.retries = C.uint64_t(res.Retries)
			opts.resends = C.uint64_t(res.Resends)
		}
		return nil
	})
}

//export mcgRead
func mcgRead(h C.mc_guard_t, session *C.char, local, remote, length *C.uint64_t, n C.size_t) C.mc_status {
	return run(h, "mc_guard_read", func(g *core.Guard) error {
		name, descs, err := batchArgs(session, local, remote, length, n)
		if err != nil {
			return err
		}
		return g.Read(name, descs)
	})
}

//export mcgCancel
func mcgCancel(h C.mc_guard_t, session *C.char) C.mc_status {
	return run(h, "mc_guard_cancel", func(g *core.Guard) error {
		if session == nil {
			return fmt.Errorf("%w: session is NULL", errs.InvalidArg)
		}
		return g.Cancel(C.GoString(session))
	})
}

//export mcgWaitEngineCalls
func mcgWaitEngineCalls(h C.mc_guard_t, transferID, timeoutMS C.uint64_t) C.mc_status {
	return run(h, "mc_guard_wait_engine_calls", func(g *core.Guard) error {
		if timeoutMS > C.uint64_t(maxWait/time.Millisecond) {
			return fmt.Errorf("%w: timeout_ms = %d is over a day", errs.InvalidArg, uint64(timeoutMS))
		}
		return g.WaitEngineCalls(uint64(transferID), time.Duration(timeoutMS)*time.Millisecond)
	})
}

//export mcgQuiesceEngine
func mcgQuiesceEngine(h C.mc_guard_t, session *C.char, addr, length *C.uint64_t, n C.size_t) C.mc_status {
	return run(h, "mc_guard_quiesce_engine", func(g *core.Guard) error {
		if session == nil {
			return fmt.Errorf("%w: session is NULL", errs.InvalidArg)
		}
		ranges, err := syncRanges(addr, length, n)
		if err != nil {
			return err
		}
		return g.QuiesceEngine(C.GoString(session), ranges)
	})
}

//export mcgPeerRegions
func mcgPeerRegions(h C.mc_guard_t, session *C.char, addr, length *C.uint64_t, capacity C.size_t, n *C.size_t) C.mc_status {
	return run(h, "mc_guard_peer_regions", func(g *core.Guard) error {
		if session == nil {
			return fmt.Errorf("%w: session is NULL", errs.InvalidArg)
		}
		if capacity > 0 && (addr == nil || length == nil) {
			return fmt.Errorf("%w: addr or len is NULL with capacity %d", errs.InvalidArg, capacity)
		}
		regions, err := g.PeerRegions(C.GoString(session))
		if err != nil {
			return err
		}
		if n != nil {
			*n = C.size_t(len(regions))
		}
		if uint64(len(regions)) > uint64(capacity) {
			return fmt.Errorf("%w: session has %d regions, room for %d", errBufferTooSmall, len(regions), uint64(capacity))
		}
		if len(regions) > 0 {
			addrs := unsafe.Slice((*uint64)(unsafe.Pointer(addr)), len(regions))
			lens := unsafe.Slice((*uint64)(unsafe.Pointer(length)), len(regions))
			for i, r := range regions {
				addrs[i], lens[i] = r.Addr, r.Len
			}
		}
		return nil
	})
}

//export mcgNotify
func mcgNotify(h C.mc_guard_t, session, name, msg *C.char, msgLen C.size_t) C.mc_status {
	return run(h, "mc_guard_notify", func(g *core.Guard) error {
		if session == nil || name == nil || (msg == nil && msgLen > 0) {
			return fmt.Errorf("%w: session, name or msg is NULL", errs.InvalidArg)
		}
		if uint64(msgLen) > core.MaxNotifyMsg {
			return fmt.Errorf("%w: notify message of %d bytes, limit %d", errs.InvalidArg, uint64(msgLen), core.MaxNotifyMsg)
		}
		var body string
		if msgLen > 0 {
			body = C.GoStringN(msg, C.int(msgLen))
		}
		return g.Notify(C.GoString(session), core.Notify{Name: C.GoString(name), Msg: body})
	})
}
