package tcp

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"github.com/mcguard/mcguard/core/desc"
	"runtime"
	"slices"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/core/fault"
	"github.com/mcguard/mcguard/core/logs"
	"github.com/mcguard/mcguard/core/memory"
	"github.com/mcguard/mcguard/core/sharedmem"
	"github.com/mcguard/mcguard/core/transport/samehost"
)

// Same-host writes by the sender: where the target handed this connection
// a lease slot (lease.go), a batch whose sources are host memory here and
// whose destinations are all in the target's lease table is written
// straight into the target with process_vm_writev, and tail read-backs are
// read with process_vm_readv: no frame, no socket round trip, no target
// thread. The call is a synchronous kernel copy, so its return means the
// bytes are in the target's memory; a fence has nothing left to wait for.
// Where a destination lies in a shared allocation of the target
// (core/sharedmem), the sender maps that allocation once and copies with
// memcpy instead: no system call at all. Anything else (device memory, a
// region the table does not hold, a changing table, a kernel that refuses
// the calls) goes the socket's way.

// pushLease is a sender connection's view of the target's lease file.
type pushLease struct {
	mem   leaseWords
	slot  int
	epoch uint64 // the slot's owner while it is this connection's
	// within: a transfer is under way that began under quiesce generation
	// since; a newer one at the target ends this connection's own writes
	// for it (enter declines).
	within bool
	since  uint64
	pid    int // the target
	pidfd  int // the target process, to see that it was alive when a memcpy into its memory ended

	spans    []span                        // the last enter's ranges: the shared allocation each lies in
	maps     map[uint64]*sharedmem.Mapping // the target's shared allocations mapped here, by inode
	unmapped map[uint64]bool               // inodes that could not be mapped: process_vm_writev
	mapGen   uint64                        // the gen maps were last checked against the table under
}

// attachLease maps the target's lease file: fd in process pid, checked
// against the handshake's nonce. It returns why not, or "".
func attachLease(pid, fd int, nonceHex string, slot int, epoch uint64) (*pushLease, string) {
	nonce, err := hex.DecodeString(nonceHex)
	if err != nil || len(nonce) != leaseNonceSize || slot < 0 || slot >= maxLeaseSlots || fd < 0 {
		return nil, "the receiver's lease is malformed"
	}
	pidfd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return nil, "pidfd_open: " + err.Error()
	}
	keep := false
	defer func() {
		if !keep {
			unix.Close(pidfd)
		}
	}()
	own, err := unix.PidfdGetfd(pidfd, fd, 0)
	if err != nil {
		return nil, "pidfd_getfd: " + err.Error()
	}
	defer unix.Close(own)
	var st unix.Stat_t
	if err := unix.Fstat(own, &st); err != nil || st.Size != leaseSize {
		return nil, "the receiver's lease file has the wrong size"
	}
	mem, err := unix.Mmap(own, 0, leaseSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, "mapping the lease: " + err.Error()
	}
	if string(mem[:leaseNonceSize]) != string(nonce) {
		unix.Munmap(mem)
		return nil, "the receiver's lease file is not the one its handshake named"
	}
	keep = true
	return &pushLease{mem: mem, slot: slot, epoch: epoch, pid: pid, pidfd: pidfd,
		maps: map[uint64]*sharedmem.Mapping{}, unmapped: map[uint64]bool{}}, ""
}

func (p *pushLease) close() {
	for _, m := range p.maps {
		m.Release()
	}
	clear(p.maps)
	unix.Munmap(p.mem)
	unix.Close(p.pidfd)
}

// errRevoked: the target aborted this connection (or it ended there).
var errRevoked = errors.New("the receiver revoked this connection's same-host writes")

// maxEnterTries bounds the tries to find the table stable; past them the
// batch goes through the socket.
const maxEnterTries = 64

// enter marks this slot busy under a stable gen in which every range is in
// the target's table. ok false: write them through the socket instead.
func (p *pushLease) enter(ranges []desc.Range) (ok bool, err error) {
	busy := p.mem.busy(p.slot)
	for try := 0; try < maxEnterTries; try++ {
		g := atomic.LoadUint64(p.mem.gen())
		if g&1 != 0 {
			runtime.Gosched() // the target is changing its table
			continue
		}
		atomic.StoreUint64(busy, g+1)
		if atomic.LoadUint64(p.mem.gen()) != g {
			atomic.StoreUint64(busy, 0)
			continue
		}
		if atomic.LoadUint64(p.mem.owner(p.slot)) != p.epoch {
			atomic.StoreUint64(busy, 0)
			return false, errRevoked
		}
		if p.within && atomic.LoadUint64(p.mem.quiesce()) > p.since {
			atomic.StoreUint64(busy, 0) // quiesced since the transfer began: the socket, where the target checks
			return false, nil
		}
		covered := p.covers(ranges)
		if atomic.LoadUint64(p.mem.gen()) != g {
			atomic.StoreUint64(busy, 0) // the table moved while we read it
			continue
		}
		if g != p.mapGen {
			p.pruneMaps()
			p.mapGen = g
		}
		if !covered {
			atomic.StoreUint64(busy, 0)
			return false, nil
		}
		return true, nil
	}
	return false, nil
}

func (p *pushLease) exit() { atomic.StoreUint64(p.mem.busy(p.slot), 0) }

// covers reports whether every range lies inside one region of the
// table, and notes in spans the shared allocation each lies in.
func (p *pushLease) covers(ranges []desc.Range) bool {
	n := min(int(atomic.LoadUint64(p.mem.count())), maxLeaseRegions)
	p.spans = p.spans[:0]
	last := -1 // batches mostly stay in one region: try it first
	var at span
	for _, r := range ranges {
		if last < 0 || !p.inEntry(last, r) {
			last = -1
			for i := 0; i < n; i++ {
				if p.inEntry(i, r) {
					last = i
					break
				}
			}
			if last < 0 {
				return false
			}
			at = p.spanOf(last)
		}
		p.spans = append(p.spans, at)
	}
	return true
}

func (p *pushLease) inEntry(i int, r desc.Range) bool {
	a, n := p.mem.entry(i)
	base, size := atomic.LoadUint64(a), atomic.LoadUint64(n)
	return r.Len > 0 && r.Addr >= base && r.Addr+r.Len >= r.Addr && r.Addr+r.Len <= base+size
}

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
	ok, err := t.lease.enter(t.ranges)
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
		err = fmt.Errorf("%w: the receiving process %d closed the data connection", errs.Peer, t.lease.pid)
	case ctx.Err() != nil:
		err = ctx.Err()
	default:
		var rest uint64
		mapped, rest = t.copyMapped()
		if rest > 0 {
			err = samehost.CopyParallel(t.lease.pid, t.iovLocal, t.iovRemote, rest)
		}
		if err == nil && mapped > 0 {
			err = t.lease.alive()
		}
	}
	t.lease.exit()
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
		t.lease.close()
		t.lease = nil
		return nil
	}
	return fmt.Errorf("%w: writing into the receiving process: %v", errs.Peer, err)
}

// pullRanges reads ranges out of the target into out itself, where they
// are all in its table; done false: read them through the socket.
func (t *conn) pullRanges(ranges []desc.Range, out []byte) (done bool, err error) {
	ok, err := t.lease.enter(ranges)
	if err != nil {
		return false, fmt.Errorf("%w: %v", errs.Peer, err)
	}
	if !ok {
		return false, nil
	}
	defer t.lease.exit()
	t.iovLocal, t.iovRemote = t.iovLocal[:0], t.iovRemote[:0]
	mapped := false
	for i, r := range ranges { // enter refused empty ranges
		if src := t.lease.mapped(i, r); src != nil {
			out = out[copy(out, src):]
			mapped = true
			continue
		}
		lv := unix.Iovec{Base: &out[0]}
		lv.SetLen(int(r.Len))
		t.iovLocal = append(t.iovLocal, lv)
		t.iovRemote = append(t.iovRemote, unix.RemoteIovec{Base: uintptr(r.Addr), Len: int(r.Len)})
		out = out[r.Len:]
	}
	if err := samehost.Copy(t.lease.pid, t.iovLocal, t.iovRemote, false); err != nil {
		return false, fmt.Errorf("%w: reading back from the receiving process: %v", errs.Peer, err)
	}
	if mapped {
		if err := t.lease.alive(); err != nil {
			return false, err
		}
	}
	return true, nil
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
			if samehost.Read(t.lease.pid, uint64(t.iovRemote[i].Base)+uint64(n-len(dstTail)), dstTail) != nil {
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
