package tcp

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/mcguard/mcguard/core/desc"
	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/core/fault"
	"github.com/mcguard/mcguard/core/logs"
	"github.com/mcguard/mcguard/core/memory"
	"github.com/mcguard/mcguard/core/transport/samehost"
)

// Same-host writes by the sender: where the target handed this connection
// a lease slot (samehost.Lease), a batch whose sources are host memory here and
// whose destinations are all in the target's lease table is written
// straight into the target with process_vm_writev, and tail read-backs are
// read with process_vm_readv: no frame, no socket round trip, no target
// thread. The call is a synchronous kernel copy, so its return means the
// bytes are in the target's memory; a fence has nothing left to wait for.
// Where a destination lies in a shared allocation of the target
// (core/transport/samehost), the sender maps that allocation once and copies with
// memcpy instead: no system call at all. Anything else (device memory, a
// region the table does not hold, a changing table, a kernel that refuses
// the calls) goes the socket's way.

// logPushFallback says, once per process, why same-host writes by the
// sender stopped and the receiver copies the bytes instead.
func logPushFallback(why string) {
	pushFallback.Printf(logs.Info, "same-host writes by the sender not used (the receiver copies the bytes instead): %s", why)
}

// push writes descs into the target itself. done false (and no error):
// send them through the socket.
func (t *conn) push(ctx context.Context, descs []desc.Desc) (done bool, err error) {
	if len(descs) == 0 {
		return false, nil
	}
	t.iovLocal, t.iovRemote, t.ranges = t.iovLocal[:0], t.iovRemote[:0], t.ranges[:0]
	var total uint64
	for _, d := range descs {
		held, mem, err := t.local.Hold(d.Src, d.Len)
		if err != nil || mem.Device {
			if err == nil {
				held.Release()
			}
			t.unpin()
			return false, nil // the socket path says what is wrong with it
		}
		t.pins = append(t.pins, held)
		lv := unix.Iovec{Base: (*byte)(unsafe.Pointer(uintptr(d.Src)))}
		lv.SetLen(int(d.Len))
		t.iovLocal = append(t.iovLocal, lv)
		t.iovRemote = append(t.iovRemote, unix.RemoteIovec{Base: uintptr(d.Dst), Len: int(d.Len)})
		t.ranges = append(t.ranges, desc.Range{Addr: d.Dst, Len: d.Len})
		total += d.Len
	}
	defer t.unpin()
	ok, err := t.lease.Enter(t.ranges)
	if err != nil {
		return false, fmt.Errorf("%w: %v", errs.Peer, err)
	}
	if !ok {
		return false, nil
	}
	if t.faults != nil {
		t.injectFaults()
	}
	var mapped uint64
	switch {
	case t.closedByPeer: // begin's peek: the target (maybe its process) is gone, and its pid may be another's
		err = fmt.Errorf("%w: the receiving process %d closed the data connection", errs.Peer, t.lease.Pid())
	case ctx.Err() != nil:
		err = ctx.Err()
	default:
		var rest uint64
		mapped, rest = t.copyMapped()
		if rest > 0 {
			err = samehost.CopyParallel(t.lease.Pid(), t.iovLocal, t.iovRemote, rest)
		}
		if err == nil && mapped > 0 {
			err = t.lease.Alive()
		}
	}
	t.lease.Exit()
	if err != nil {
		return false, t.pushFailed(err)
	}
	if t.pushed != nil {
		t.pushed.Add(int64(total))
	}
	if t.mapped != nil && mapped > 0 {
		t.mapped.Add(int64(mapped))
	}
	return true, nil
}

// pushFailed turns a failed process_vm_writev into what the caller does:
// where the kernel refuses it (seccomp, a changed ptrace rule), the
// connection stops pushing and the batch goes through the socket; other
// failures fail the transfer.
func (t *conn) pushFailed(err error) error {
	var errno syscall.Errno
	if !errors.As(err, &errno) {
		return err
	}
	if errors.Is(err, syscall.EPERM) || errors.Is(err, syscall.EACCES) || errors.Is(err, syscall.ENOSYS) {
		logPushFallback("process_vm_writev: " + err.Error())
		t.lease.Close()
		t.lease = nil
		return nil
	}
	return fmt.Errorf("%w: writing into the receiving process: %v", errs.Peer, err)
}

// pullRanges reads ranges out of the target into out itself, where they
// are all in its table; done false: read them through the socket.
func (t *conn) pullRanges(ranges []desc.Range, out []byte) (done bool, err error) {
	ok, err := t.lease.Enter(ranges)
	if err != nil {
		return false, fmt.Errorf("%w: %v", errs.Peer, err)
	}
	if !ok {
		return false, nil
	}
	defer t.lease.Exit()
	t.iovLocal, t.iovRemote = t.iovLocal[:0], t.iovRemote[:0]
	mapped := false
	first, end, pieces := -1, uint64(0), 0 // the open span: its first range, its end, the pieces it fills
	for i, r := range ranges {             // enter refused empty ranges
		if src := t.lease.Mapped(i, r); src != nil {
			out = out[copy(out, src):]
			mapped, first = true, -1
			continue
		}
		// A range shortly after the open span's end, in the same
		// registered region, extends the span: the bytes between go to
		// the gap piece (sample's head, stripes and tail of one block
		// are one span, not six).
		if first >= 0 && r.Addr >= end && r.Addr-end <= pullGap && pieces+2 <= maxSpanPieces && t.lease.SameRegion(first, i) {
			if gap := r.Addr - end; gap > 0 {
				t.iovLocal = append(t.iovLocal, t.gapPiece(gap))
				pieces++
			}
			t.iovRemote[len(t.iovRemote)-1].Len += int(r.Addr + r.Len - end)
		} else {
			first, pieces = i, 0
			t.iovRemote = append(t.iovRemote, unix.RemoteIovec{Base: uintptr(r.Addr), Len: int(r.Len)})
		}
		lv := unix.Iovec{Base: &out[0]}
		lv.SetLen(int(r.Len))
		t.iovLocal = append(t.iovLocal, lv)
		end, pieces, out = r.Addr+r.Len, pieces+1, out[r.Len:]
	}
	if err := samehost.ReadSpans(t.lease.Pid(), t.iovLocal, t.iovRemote); err != nil {
		return false, fmt.Errorf("%w: reading back from the receiving process: %v", errs.Peer, err)
	}
	if mapped {
		if err := t.lease.Alive(); err != nil {
			return false, err
		}
	}
	return true, nil
}

// pullGap is the most bytes between two ranges that pullRanges reads
// through rather than start another span: at about 0.04 ns a byte
// against 0.5 µs a span, a page of them costs less than a span.
const pullGap = 4096

// maxSpanPieces bounds the pieces one span fills (samehost.ReadSpans
// takes at most IOV_MAX).
const maxSpanPieces = 64

// gapPiece is a piece of n bytes (at most pullGap) that bytes read
// between two ranges go to, and are dropped.
func (t *conn) gapPiece(n uint64) unix.Iovec {
	if t.gap == nil {
		t.gap = make([]byte, pullGap)
	}
	v := unix.Iovec{Base: &t.gap[0]}
	v.SetLen(int(n))
	return v
}

func (t *conn) unpin() {
	for _, h := range t.pins {
		h.Release()
	}
	clear(t.pins)
	t.pins = t.pins[:0]
}

// pushFaults reports whether senders may write into a target with these
// faults themselves: none, or one that acts on each write at once (drop,
// tear, stale), which the sender injects on the target's behalf. Faults
// that hold writes back need the target to apply them later.
func pushFaults(f *fault.Injector) bool {
	switch f.Mode() {
	case fault.None, fault.Drop, fault.Tear, fault.Stale:
		return true
	}
	return false
}

// injectFaults cuts the pending push's pairs as the target's fault says
// (under the lease: stale reads the destination's tail): a dropped write
// becomes an empty pair, a torn one a prefix.
func (t *conn) injectFaults() {
	k := t.faults.TailBytes()
	for i := range t.iovLocal {
		n := int(t.iovLocal[i].Len)
		payload := memory.BytesAt(uint64(uintptr(unsafe.Pointer(t.iovLocal[i].Base))), uint64(n))
		var dstTail []byte
		if t.faults.Mode() == fault.Stale {
			dstTail = make([]byte, min(k, n))
			if samehost.Read(t.lease.Pid(), uint64(t.iovRemote[i].Base)+uint64(n-len(dstTail)), dstTail) != nil {
				dstTail = nil
			}
		}
		now, _ := t.faults.Fate(payload, dstTail)
		t.iovLocal[i].SetLen(len(now))
		t.iovRemote[i].Len = len(now)
	}
}

// peekEvery is how often a pushing connection looks at its socket (begin's
// peek, a syscall): for a target that closed it (its process may have
// ended, and its pid could in time be another process's) and for quiesce
// marks, which matter only to writes sent through the socket (and those
// read them first anyway). A pid is reused only after the kernel went
// through every other pid, which takes far longer.
const peekEvery = time.Millisecond

// pushFirst reads what earlier calls left owed and the target's quiesce
// marks (begin, whose peek also sets closedByPeer) where needed, then
// tries a push. done false (and no error): send descs through the socket.
// Answers to notices alone do not need it: they are read as they arrive
// (SettleNotices, which peeked just before).
func (t *conn) pushFirst(ctx context.Context, descs []desc.Desc) (done bool, err error) {
	if slices.ContainsFunc(t.owed, notNotice) || time.Since(t.peekedAt) >= peekEvery {
		if err := t.begin(ctx, false); err != nil {
			return false, err
		}
	}
	return t.push(ctx, descs)
}

// copyMapped copies the pending push's pairs whose destinations this
// process maps (memcpy), empties them, and returns the bytes left for
// process_vm_writev.
func (t *conn) copyMapped() (mapped, rest uint64) {
	t.copies = t.copies[:0]
	var bytes uint64
	for i := range t.iovLocal {
		n := int(t.iovLocal[i].Len) // fault injection may have cut it
		if dst := t.lease.Mapped(i, t.ranges[i]); dst != nil {
			t.copies = append(t.copies, samehost.CopyPair{Dst: dst[:n], Src: unsafe.Slice(t.iovLocal[i].Base, n)})
			bytes += uint64(n)
			mapped += t.ranges[i].Len
			t.iovLocal[i].SetLen(0)
			t.iovRemote[i].Len = 0
			continue
		}
		rest += uint64(n)
	}
	samehost.CopyPairs(t.copies, bytes)
	clear(t.copies) // no reference to the target's mapping outlives the lease
	return mapped, rest
}
