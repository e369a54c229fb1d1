// Verified reads: a producer's seal of ranges whose bytes are final, and
// a reader's read or check of the bytes it landed against it.

package main

/*
#include "mcguard.h"
*/
import "C"

import (
	"fmt"
	"time"
	"unsafe"

	"github.com/mcguard/mcguard/core"
	"github.com/mcguard/mcguard/core/desc"
	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/core/seal"
	"github.com/mcguard/mcguard/verify"
)

// sealModes maps the modes a seal is checked in; MC_VERIFY_DEFAULT is a
// digest of every byte.
var sealModes = map[C.int32_t]verify.Mode{C.MC_VERIFY_DEFAULT: verify.Digest, C.MC_VERIFY_DIGEST: verify.Digest, C.MC_VERIFY_TAIL: verify.Tail}

//export mcgSeal
func mcgSeal(h C.mc_guard_t, addr, length *C.uint64_t, n C.size_t, out *C.uint8_t, capacity C.size_t, outLen *C.size_t) C.mc_status {
	return run(h, "mc_guard_seal", func(g *core.Guard) error {
		rs, err := sealRanges(addr, length, n)
		if err != nil {
			return err
		}
		if out == nil {
			return fmt.Errorf("%w: seal is NULL", errs.InvalidArg)
		}
		s, err := g.Seal(rs)
		if err != nil {
			return err
		}
		if err := copySeal(s, out, capacity, outLen); err != nil {
			return fmt.Errorf("%w (MC_GUARD_SEAL_SIZE(%d) is enough)", err, uint64(n))
		}
		return nil
	})
}

// sealArgs checks and copies a seal and the mode it is checked in.
func sealArgs(p *C.uint8_t, n C.size_t, mode C.int32_t) ([]byte, verify.Mode, error) {
	m, ok := sealModes[mode]
	switch {
	case !ok:
		return nil, "", fmt.Errorf("%w: a seal is checked with MC_VERIFY_DIGEST or MC_VERIFY_TAIL, not mode %d", errs.InvalidArg, int32(mode))
	case p == nil || n == 0:
		return nil, "", fmt.Errorf("%w: the seal is NULL or empty", errs.InvalidArg)
	case uint64(n) > uint64(seal.Size(seal.MaxRanges)):
		return nil, "", fmt.Errorf("%w: %d bytes is longer than any seal", errs.Seal, uint64(n))
	}
	return C.GoBytes(unsafe.Pointer(p), C.int(n)), m, nil
}

//export mcgReadSealed
func mcgReadSealed(h C.mc_guard_t, session *C.char, local, remote, length *C.uint64_t, n C.size_t, sealed *C.uint8_t, sealLen C.size_t, mode C.int32_t) C.mc_status {
	return run(h, "mc_guard_read_sealed", func(g *core.Guard) error {
		name, descs, err := batchArgs(session, local, remote, length, n)
		if err != nil {
			return err
		}
		s, m, err := sealArgs(sealed, sealLen, mode)
		if err != nil {
			return err
		}
		return g.ReadSealed(name, descs, s, m)
	})
}

//export mcgCheckSeal
func mcgCheckSeal(h C.mc_guard_t, local, remote, length *C.uint64_t, n C.size_t, sealed *C.uint8_t, sealLen C.size_t, mode C.int32_t, producer *C.uint8_t) C.mc_status {
	return run(h, "mc_guard_check_seal", func(g *core.Guard) error {
		switch {
		case local == nil || length == nil:
			return fmt.Errorf("%w: the local address and length arrays must not be NULL", errs.InvalidArg)
		case n == 0 || n > core.MaxDescriptors:
			return fmt.Errorf("%w: n = %d (1 to MC_GUARD_MAX_DESCRIPTORS)", errs.InvalidArg, uint64(n))
		}
		s, m, err := sealArgs(sealed, sealLen, mode)
		if err != nil {
			return err
		}
		l, ln := cArray(local, int(n)), cArray(length, int(n))
		descs := make([]desc.Desc, n)
		for i := range descs {
			descs[i] = desc.Desc{Src: l[i], Len: ln[i]}
		}
		if remote != nil {
			for i, r := range cArray(remote, int(n)) {
				descs[i].Dst = r
			}
		}
		var want []byte
		if producer != nil {
			want = C.GoBytes(unsafe.Pointer(producer), seal.IDSize)
		}
		return g.CheckSeal(s, descs, m, want)
	})
}

//export mcgPublish
func mcgPublish(h C.mc_guard_t, name *C.char, addr, length *C.uint64_t, n C.size_t) C.mc_status {
	return run(h, "mc_guard_publish", func(g *core.Guard) error {
		if name == nil {
			return fmt.Errorf("%w: name is NULL", errs.InvalidArg)
		}
		rs, err := sealRanges(addr, length, n)
		if err != nil {
			return err
		}
		return g.Publish(C.GoString(name), rs)
	})
}

//export mcgWithdraw
func mcgWithdraw(h C.mc_guard_t, name *C.char) C.mc_status {
	return run(h, "mc_guard_withdraw", func(g *core.Guard) error {
		if name == nil {
			return fmt.Errorf("%w: name is NULL", errs.InvalidArg)
		}
		return g.Withdraw(C.GoString(name))
	})
}

//export mcgFetchSeal
func mcgFetchSeal(h C.mc_guard_t, session, name *C.char, timeoutMs C.uint64_t, out *C.uint8_t, capacity C.size_t, outLen *C.size_t) C.mc_status {
	return run(h, "mc_guard_fetch_seal", func(g *core.Guard) error {
		switch {
		case session == nil || name == nil:
			return fmt.Errorf("%w: session or name is NULL", errs.InvalidArg)
		case out == nil:
			return fmt.Errorf("%w: seal is NULL", errs.InvalidArg)
		case timeoutMs > C.uint64_t(maxWait/time.Millisecond):
			return fmt.Errorf("%w: timeout_ms %d is over a day", errs.InvalidArg, uint64(timeoutMs))
		}
		s, err := g.FetchSeal(C.GoString(session), C.GoString(name), time.Duration(timeoutMs)*time.Millisecond)
		if err != nil {
			return err
		}
		return copySeal(s, out, capacity, outLen)
	})
}

// maxWait bounds the timeouts the exports take: a day.
const maxWait = 24 * time.Hour

// copySeal copies a seal into the caller's buffer, its length into *outLen
// (also when it does not fit).
func copySeal(s []byte, out *C.uint8_t, capacity C.size_t, outLen *C.size_t) error {
	if outLen != nil {
		*outLen = C.size_t(len(s))
	}
	if len(s) > int(capacity) {
		return fmt.Errorf("%w: the seal takes %d bytes, the buffer holds %d", errBufferTooSmall, len(s), uint64(capacity))
	}
	copy(unsafe.Slice((*byte)(unsafe.Pointer(out)), len(s)), s)
	return nil
}

// sealRanges checks and decodes the ranges to seal.
func sealRanges(addr, length *C.uint64_t, n C.size_t) ([]desc.Range, error) {
	ranges, err := syncRanges(addr, length, n)
	if err != nil {
		return nil, err
	}
	if n == 0 {
		return nil, fmt.Errorf("%w: a seal needs at least one range", errs.InvalidArg)
	}
	rs := make([]desc.Range, len(ranges))
	for i, r := range ranges {
		rs[i] = desc.Range{Addr: r.Addr, Len: r.Len}
	}
	return rs, nil
}

//export mcgGuardID
func mcgGuardID(h C.mc_guard_t, out *C.uint8_t, capacity C.size_t) C.mc_status {
	return run(h, "mc_guard_id", func(g *core.Guard) error {
		if out == nil || capacity < seal.IDSize {
			return fmt.Errorf("%w: the identity takes %d bytes (MC_GUARD_ID_SIZE)", errBufferTooSmall, seal.IDSize)
		}
		id := g.ID()
		copy(unsafe.Slice((*byte)(unsafe.Pointer(out)), seal.IDSize), id[:])
		return nil
	})
}
