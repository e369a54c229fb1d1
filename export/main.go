// Command export is libmcguard's C ABI: the //export functions and nothing
// else. Each decodes its C arguments, looks up the handle, calls core, and
// maps the error to a status code and a per-thread message. The public
// names (mc_guard_*) are C functions in shim.c that call these.
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
	"time"
	"unsafe"

	"github.com/mcguard/mcguard/core"
	"github.com/mcguard/mcguard/verify"
)

func main() {}

// cGetenv reads the live C environment, which a host program (Python's
// os.environ) may have changed after the library loaded.
func cGetenv(name string) (string, bool) {
	cs := C.CString(name)
	defer C.free(unsafe.Pointer(cs))
	v := C.mcg_getenv(cs)
	if v == nil {
		return "", false
	}
	return C.GoString(v), true
}

//export mcgOpen
func mcgOpen(configJSON *C.char, out *C.mc_guard_t) (st C.mc_status) {
	defer recoverInto(&st, 0, "mc_guard_open")
	if out == nil {
		return fail(0, fmt.Errorf("%w: out is NULL", core.ErrInvalidArg))
	}
	js := ""
	if configJSON != nil {
		js = C.GoString(configJSON)
	}
	cfg, err := core.LoadConfig(cGetenv, js)
	if err != nil {
		return fail(0, err)
	}
	g, err := core.Open(cfg)
	if err != nil {
		return fail(0, err)
	}
	*out = C.mc_guard_t(handles.add(g))
	return C.MC_OK
}

//export mcgClose
func mcgClose(h C.mc_guard_t) (st C.mc_status) {
	defer recoverInto(&st, h, "mc_guard_close")
	g, err := handles.remove(uint64(h))
	if err != nil {
		return fail(h, err)
	}
	if err := g.Close(); err != nil {
		return fail(h, err)
	}
	return C.MC_OK
}

//export mcgRegister
func mcgRegister(h C.mc_guard_t, addr unsafe.Pointer, n C.size_t) C.mc_status {
	return run(h, "mc_guard_register", func(g *core.Guard) error {
		return g.Register(uint64(uintptr(addr)), uint64(n))
	})
}

//export mcgRegisterDevice
func mcgRegisterDevice(h C.mc_guard_t, addr unsafe.Pointer, n C.size_t) C.mc_status {
	return run(h, "mc_guard_register_device", func(g *core.Guard) error {
		return g.RegisterDevice(uint64(uintptr(addr)), uint64(n))
	})
}

//export mcgUnregister
func mcgUnregister(h C.mc_guard_t, addr unsafe.Pointer) C.mc_status {
	return run(h, "mc_guard_unregister", func(g *core.Guard) error {
		return g.Unregister(uint64(uintptr(addr)))
	})
}

// cArray views a C array of n uint64s; n has been checked against the limit.
func cArray(p *C.uint64_t, n int) []uint64 {
	return unsafe.Slice((*uint64)(unsafe.Pointer(p)), n)
}

// verifyModes maps MC_VERIFY_* to modes, in the header's numbering.
var verifyModes = map[C.int32_t]verify.Mode{C.MC_VERIFY_OFF: verify.Off, C.MC_VERIFY_TAIL: verify.Tail,
	C.MC_VERIFY_SAMPLE: verify.Sample, C.MC_VERIFY_FULL: verify.Full, C.MC_VERIFY_DIGEST: verify.Digest}

// batchArgs checks and decodes the arguments mc_guard_transfer and
// mc_guard_read share: a session name and n (local, remote, len) triples.
func batchArgs(session *C.char, local, remote, length *C.uint64_t, n C.size_t) (string, []verify.Desc, error) {
	switch {
	case session == nil:
		return "", nil, fmt.Errorf("%w: session is NULL", core.ErrInvalidArg)
	case n == 0:
		return "", nil, fmt.Errorf("%w: n is 0: a batch needs at least one descriptor", core.ErrInvalidArg)
	case n > core.MaxDescriptors:
		return "", nil, fmt.Errorf("%w: n = %d is over MC_GUARD_MAX_DESCRIPTORS (%d)", core.ErrInvalidArg, uint64(n), core.MaxDescriptors)
	case local == nil || remote == nil || length == nil:
		return "", nil, fmt.Errorf("%w: the address and length arrays must not be NULL", core.ErrInvalidArg)
	}
	k := int(n)
	l, r, ln := cArray(local, k), cArray(remote, k), cArray(length, k)
	descs := make([]verify.Desc, k)
	for i := range descs {
		descs[i] = verify.Desc{Src: l[i], Dst: r[i], Len: ln[i]}
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
				return fmt.Errorf("%w: opts->struct_size is %d, want sizeof(mc_transfer_opts) = %d", core.ErrInvalidArg, opts.struct_size, unsafe.Sizeof(*opts))
			}
			if grown {
				if opts.deadline_ms > C.uint64_t(24*time.Hour/time.Millisecond) {
					return fmt.Errorf("%w: opts->deadline_ms = %d is over a day", core.ErrInvalidArg, uint64(opts.deadline_ms))
				}
				o.Deadline = time.Duration(opts.deadline_ms) * time.Millisecond
			}
			if opts.verify != C.MC_VERIFY_DEFAULT {
				m, ok := verifyModes[opts.verify]
				if !ok {
					return fmt.Errorf("%w: opts->verify = %d is not an MC_VERIFY_* value", core.ErrInvalidArg, opts.verify)
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
		if err != nil {
			return err
		}
		if opts != nil {
			opts.transfer_id = C.uint64_t(res.ID)
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

// checkSyncOpts validates opts, which may be NULL.
func checkSyncOpts(opts *C.mc_sync_opts) error {
	if opts != nil && opts.struct_size < C.uint32_t(unsafe.Sizeof(*opts)) {
		return fmt.Errorf("%w: opts->struct_size is %d, want sizeof(mc_sync_opts) = %d", core.ErrInvalidArg, opts.struct_size, unsafe.Sizeof(*opts))
	}
	return nil
}

//export mcgSync
func mcgSync(h C.mc_guard_t, addr, length *C.uint64_t, n C.size_t, opts *C.mc_sync_opts) C.mc_status {
	return run(h, "mc_guard_sync", func(g *core.Guard) error {
		if err := checkSyncOpts(opts); err != nil {
			return err
		}
		ranges, err := syncRanges(addr, length, n)
		if err != nil {
			return err
		}
		var digests []uint64
		if n > 0 && opts != nil && opts.digests != nil {
			digests = append([]uint64(nil), cArray(opts.digests, int(n))...)
		}
		stream := uint64(0)
		if opts != nil {
			stream = uint64(opts.stream)
		}
		return g.Sync(ranges, digests, stream)
	})
}

//export mcgSyncTransfers
func mcgSyncTransfers(h C.mc_guard_t, ids *C.uint64_t, n C.size_t, opts *C.mc_sync_opts) C.mc_status {
	return run(h, "mc_guard_sync_transfers", func(g *core.Guard) error {
		if err := checkSyncOpts(opts); err != nil {
			return err
		}
		switch {
		case n == 0 || n > core.MaxDescriptors:
			return fmt.Errorf("%w: n = %d transfer ids (1 to MC_GUARD_MAX_DESCRIPTORS)", core.ErrInvalidArg, uint64(n))
		case ids == nil:
			return fmt.Errorf("%w: transfer_ids is NULL", core.ErrInvalidArg)
		}
		stream := uint64(0)
		if opts != nil {
			stream = uint64(opts.stream)
		}
		return g.SyncTransfers(append([]uint64(nil), cArray(ids, int(n))...), stream)
	})
}

//export mcgCancel
func mcgCancel(h C.mc_guard_t, session *C.char) C.mc_status {
	return run(h, "mc_guard_cancel", func(g *core.Guard) error {
		if session == nil {
			return fmt.Errorf("%w: session is NULL", core.ErrInvalidArg)
		}
		return g.Cancel(C.GoString(session))
	})
}

//export mcgQuiesce
func mcgQuiesce(h C.mc_guard_t, addr, length *C.uint64_t, n C.size_t) C.mc_status {
	return run(h, "mc_guard_quiesce", func(g *core.Guard) error {
		ranges, err := syncRanges(addr, length, n)
		if err != nil {
			return err
		}
		return g.Quiesce(ranges)
	})
}

// syncRanges decodes the n (addr, len) ranges that mc_guard_sync and
// mc_guard_quiesce take.
func syncRanges(addr, length *C.uint64_t, n C.size_t) ([]core.SyncRange, error) {
	switch {
	case n > core.MaxDescriptors:
		return nil, fmt.Errorf("%w: n = %d is over MC_GUARD_MAX_DESCRIPTORS", core.ErrInvalidArg, uint64(n))
	case n > 0 && (addr == nil || length == nil):
		return nil, fmt.Errorf("%w: addr and len must not be NULL when n > 0", core.ErrInvalidArg)
	}
	ranges := make([]core.SyncRange, int(n))
	if n > 0 {
		a, l := cArray(addr, int(n)), cArray(length, int(n))
		for i := range ranges {
			ranges[i] = core.SyncRange{Addr: a[i], Len: l[i]}
		}
	}
	return ranges, nil
}

//export mcgEndpoint
func mcgEndpoint(h C.mc_guard_t, buf *C.char, n C.size_t) C.mc_status {
	return run(h, "mc_guard_endpoint", func(g *core.Guard) error {
		return copyOut(g.Endpoint(), buf, n, nil)
	})
}

//export mcgStats
func mcgStats(h C.mc_guard_t, buf *C.char, n C.size_t, needed *C.size_t) C.mc_status {
	return run(h, "mc_guard_stats", func(g *core.Guard) error {
		js, err := g.Stats()
		if err != nil {
			return err
		}
		return copyOut(string(js), buf, n, needed)
	})
}

//export mcgMetrics
func mcgMetrics(h C.mc_guard_t, buf *C.char, n C.size_t, needed *C.size_t) C.mc_status {
	return run(h, "mc_guard_metrics", func(g *core.Guard) error {
		text, err := g.Metrics()
		if err != nil {
			return err
		}
		return copyOut(string(text), buf, n, needed)
	})
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

var errBufferTooSmall = errors.New("buffer too small")

// copyOut writes s and a NUL into the caller's buffer of n bytes.
func copyOut(s string, buf *C.char, n C.size_t, needed *C.size_t) error {
	if needed != nil {
		*needed = C.size_t(len(s))
	}
	if buf == nil {
		return fmt.Errorf("%w: buf is NULL", core.ErrInvalidArg)
	}
	if uint64(n) < uint64(len(s))+1 {
		return fmt.Errorf("%w: %d bytes needed, buffer has %d", errBufferTooSmall, len(s)+1, uint64(n))
	}
	out := unsafe.Slice((*byte)(unsafe.Pointer(buf)), len(s)+1)
	copy(out, s)
	out[len(s)] = 0
	return nil
}

// statusOf maps an error to its status. ErrClosed comes first: a transfer
// cut off by close wraps both it and the I/O error that close caused.
func statusOf(err error) C.mc_status {
	table := []struct {
		err error
		st  C.mc_status
	}{
		{core.ErrClosed, C.MC_ERR_CLOSED},
		{core.ErrCancelled, C.MC_ERR_CANCELLED},
		{errBadHandle, C.MC_ERR_BAD_HANDLE},
		{errBufferTooSmall, C.MC_ERR_BUFFER_TOO_SMALL},
		{core.ErrInvalidArg, C.MC_ERR_INVALID_ARG},
		{core.ErrConfig, C.MC_ERR_CONFIG},
		{core.ErrNotRegistered, C.MC_ERR_NOT_REGISTERED},
		{core.ErrDevice, C.MC_ERR_DEVICE},
		{core.ErrVerify, C.MC_ERR_VERIFY},
		{core.ErrQuiesced, C.MC_ERR_QUIESCED},
		{core.ErrTimeout, C.MC_ERR_TIMEOUT},
		{core.ErrSession, C.MC_ERR_SESSION},
		{core.ErrPeer, C.MC_ERR_PEER},
	}
	for _, e := range table {
		if errors.Is(err, e.err) {
			return e.st
		}
	}
	return C.MC_ERR_INTERNAL
}

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

//export mcgPeerRegions
func mcgPeerRegions(h C.mc_guard_t, session *C.char, addr, length *C.uint64_t, capacity C.size_t, n *C.size_t) C.mc_status {
	return run(h, "mc_guard_peer_regions", func(g *core.Guard) error {
		if session == nil {
			return fmt.Errorf("%w: session is NULL", core.ErrInvalidArg)
		}
		if capacity > 0 && (addr == nil || length == nil) {
			return fmt.Errorf("%w: addr or len is NULL with capacity %d", core.ErrInvalidArg, capacity)
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
			return fmt.Errorf("%w: session, name or msg is NULL", core.ErrInvalidArg)
		}
		if uint64(msgLen) > core.MaxNotifyMsg {
			return fmt.Errorf("%w: notify message of %d bytes, limit %d", core.ErrInvalidArg, uint64(msgLen), core.MaxNotifyMsg)
		}
		var body string
		if msgLen > 0 {
			body = C.GoStringN(msg, C.int(msgLen))
		}
		return g.Notify(C.GoString(session), core.Notify{Name: C.GoString(name), Msg: body})
	})
}

//export mcgNotifies
func mcgNotifies(h C.mc_guard_t, buf *C.char, n C.size_t, needed *C.size_t) C.mc_status {
	return run(h, "mc_guard_notifies", func(g *core.Guard) error {
		if buf == nil {
			return fmt.Errorf("%w: buf is NULL", core.ErrInvalidArg)
		}
		room := int(min(uint64(n), 1<<40)) - 1 // the NUL
		js, size, err := g.Notifies(room)
		if err != nil {
			return err
		}
		if js == nil {
			if needed != nil {
				*needed = C.size_t(size)
			}
			return fmt.Errorf("%w: %d bytes needed, buffer has %d (the notifies stay queued)", errBufferTooSmall, size+1, uint64(n))
		}
		return copyOut(string(js), buf, n, needed)
	})
}
