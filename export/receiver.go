// The receiver's exports: sync by ranges or transfer ids, quiesce, and
// the notifies received.

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
	"unsafe"

	"github.com/mcguard/mcguard/core"
	"github.com/mcguard/mcguard/core/errs"
)

// checkSyncOpts validates opts, which may be NULL.
func checkSyncOpts(opts *C.mc_sync_opts) error {
	if opts != nil && opts.struct_size < C.uint32_t(unsafe.Sizeof(*opts)) {
		return fmt.Errorf("%w: opts->struct_size is %d, want sizeof(mc_sync_opts) = %d", errs.InvalidArg, opts.struct_size, unsafe.Sizeof(*opts))
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
			return fmt.Errorf("%w: n = %d transfer ids (1 to MC_GUARD_MAX_DESCRIPTORS)", errs.InvalidArg, uint64(n))
		case ids == nil:
			return fmt.Errorf("%w: transfer_ids is NULL", errs.InvalidArg)
		}
		stream := uint64(0)
		if opts != nil {
			stream = uint64(opts.stream)
		}
		return g.SyncTransfers(append([]uint64(nil), cArray(ids, int(n))...), stream)
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
		return nil, fmt.Errorf("%w: n = %d is over MC_GUARD_MAX_DESCRIPTORS", errs.InvalidArg, uint64(n))
	case n > 0 && (addr == nil || length == nil):
		return nil, fmt.Errorf("%w: addr and len must not be NULL when n > 0", errs.InvalidArg)
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

//export mcgNotifies
func mcgNotifies(h C.mc_guard_t, buf *C.char, n C.size_t, needed *C.size_t) C.mc_status {
	return run(h, "mc_guard_notifies", func(g *core.Guard) error {
		if buf == nil {
			return fmt.Errorf("%w: buf is NULL", errs.InvalidArg)
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
