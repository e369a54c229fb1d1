package tcp

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"runtime"
	"sync"
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
	"github.com/mcguard/mcguard/verify"
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
	pid   int    // the target
	pidfd int    // the target process, to see that it was alive when a memcpy into its memory ended

	spans    []span                        // the last enter's ranges: the shared allocation each lies in
	maps     map[uint64]*sharedmem.Mapping // the target's shared allocations mapped here, by inode
	unmapped map[uint64]bool               // inodes that could not be mapped: process_vm_writev
	mapGen   uint64                        // the gen maps were last checked against the table under
}

// span is the shared allocation (base, size, descriptor and inode in the
// target) that a range lies in; ino 0: none.
type span struct{ base, size, fd, ino uint64 }

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
func (p *pushLease) enter(ranges []verify.Range) (ok bool, err error) {
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
func (p *pushLease) covers(ranges []verify.Range) bool {
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

func (p *pushLease) spanOf(i int) span {
	return span{atomic.LoadUint64(p.mem.field(i, 2)), atomic.LoadUint64(p.mem.field(i, 3)),
		atomic.LoadUint64(p.mem.field(i, 4)), atomic.LoadUint64(p.mem.field(i, 5))}
}

// mapped is where range i of the last enter lies in this process's
// mapping of the target's shared allocation, or nil (none, or it cannot
// be mapped: logged once, and process_vm_writev takes it). Only between
// enter and exit, when the target cannot free the allocation.
func (p *pushLease) mapped(i int, r verify.Range) []byte {
	s := p.spans[i]
	if s.ino == 0 || p.unmapped[s.ino] || r.Addr < s.base || r.Addr-s.base > s.size || r.Len > s.size-(r.Addr-s.base) {
		return nil
	}
	m := p.maps[s.ino]
	if m == nil {
		var err error
		if m, err = sharedmem.Attach(p.pid, int(s.fd), s.ino, s.size); err != nil {
			mapFallback.Printf(logs.Info, "a receiver's shared buffer not mapped (written with process_vm_writev instead): %v", err)
			p.unmapped[s.ino] = true
			return nil
		}
		p.maps[s.ino] = m
	}
	off := r.Addr - s.base
	return m.Mem[off : off+r.Len : off+r.Len]
}

// pruneMaps lets go of the mappings (and forgets the failures) of shared
// allocations no longer in the table, so that the target's freed memory
// is freed here too; it runs when the table's gen moved.
func (p *pushLease) pruneMaps() {
	if len(p.maps) == 0 && len(p.unmapped) == 0 {
		return
	}
	n := min(int(atomic.LoadUint64(p.mem.count())), maxLeaseRegions)
	live := func(ino uint64) bool {
		for i := 0; i < n; i++ {
			if atomic.LoadUint64(p.mem.field(i, 5)) == ino {
				return true
			}
		}
		return false
	}
	for ino, m := range p.maps {
		if !live(ino) {
			m.Release()
			delete(p.maps, ino)
		}
	}
	for ino := range p.unmapped {
		if !live(ino) {
			delete(p.unmapped, ino)
		}
	}
}

func (p *pushLease) inEntry(i int, r verify.Range) bool {
	a, n := p.mem.entry(i)
	base, size := atomic.LoadUint64(a), atomic.LoadUint64(n)
	return r.Len > 0 && r.Addr >= base && r.Addr+r.Len >= r.Addr && r.Addr+r.Len <= base+size
}

// maxIov is the iovecs one process_vm_writev call takes (IOV_MAX).
const maxIov = 1024

// vmCopy copies local[i] to or from remote[i] in process pid, continuing
// short copies, IOV_MAX pairs per call; both sides' lengths match pairwise.
func vmCopy(pid int, local []unix.Iovec, remote []unix.RemoteIovec, write bool) error {
	for {
		for len(local) > 0 && local[0].Len == 0 { // an empty pair (a dropped write) at the front
			local, remote = local[1:], remote[1:]
		}
		if len(local) == 0 {
			return nil
		}
		k := min(len(local), maxIov)
		var n int
		var err error
		if write {
			n, err = unix.ProcessVMWritev(pid, local[:k], remote[:k], 0)
		} else {
			n, err = unix.ProcessVMReadv(pid, local[:k], remote[:k], 0)
		}
		if err == syscall.EINTR {
			continue
		}
		if err != nil {
			return err
		}
		if n == 0 {
			return syscall.EFAULT
		}
		// Skip the pairs done, and cut into the one done partly.
		for n > 0 && len(local) > 0 {
			l := int(local[0].Len)
			if n >= l {
				n -= l
				local, remote = local[1:], remote[1:]
				continue
			}
			local[0].Base = (*byte)(unsafe.Add(unsafe.Pointer(local[0].Base), n))
			local[0].SetLen(l - n)
			remote[0].Base += uintptr(n)
			remote[0].Len -= n
			n = 0
		}
	}
}

// logPushFallback says, once per process, why same-host writes by the
// sender stopped and the receiver copies the bytes instead.
func logPushFallback(why string) {
	pushFallback.Printf(logs.Info, "same-host writes by the sender not used (the receiver copies the bytes instead): %s", why)
}

// push writes descs into the target itself. done false (and no error):
// send them through the socket.
func (t *conn) push(ctx context.Context, descs []verify.Desc) (done bool, err error) {
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
		t.ranges = append(t.ranges, verify.Range{Addr: d.Dst, Len: d.Len})
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
			err = vmCopyParallel(t.lease.pid, t.iovLocal, t.iovRemote, rest)
		}
		if err == nil && mapped > 0 && exited(t.lease.pidfd) {
			// Its pages outlive it in our mapping: a copy into them proves
			// nothing unless the process was there when it ended.
			err = fmt.Errorf("%w: the receiving process %d has exited", errs.Peer, t.lease.pid)
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

// copyMapped copies the pending push's pairs whose destinations this
// process maps (memcpy), empties them, and returns the bytes left for
// process_vm_writev.
func (t *conn) copyMapped() (mapped, rest uint64) {
	t.copies = t.copies[:0]
	var bytes uint64
	for i := range t.iovLocal {
		n := int(t.iovLocal[i].Len) // fault injection may have cut it
		if dst := t.lease.mapped(i, t.ranges[i]); dst != nil {
			t.copies = append(t.copies, copyPair{dst[:n], unsafe.Slice(t.iovLocal[i].Base, n)})
			bytes += uint64(n)
			mapped += t.ranges[i].Len
			t.iovLocal[i].SetLen(0)
			t.iovRemote[i].Len = 0
			continue
		}
		rest += uint64(n)
	}
	copyParallel(t.copies, bytes)
	clear(t.copies) // no reference to the target's mapping outlives the lease
	return mapped, rest
}

// copyPair is a memcpy of src into dst (the same length).
type copyPair struct{ dst, src []byte }

// copyParallel copies the pairs, cut by bytes into contiguous runs over up
// to GOMAXPROCS (at most 4) goroutines where the batch is large (as
// vmCopyParallel does): one thread's copy is bound by its core's
// bandwidth.
func copyParallel(pairs []copyPair, total uint64) {
	k := min(runtime.GOMAXPROCS(0), 4)
	if total < parallelMin || k < 2 {
		for _, c := range pairs {
			copy(c.dst, c.src)
		}
		return
	}
	var wg sync.WaitGroup
	share := int((total + uint64(k) - 1) / uint64(k))
	for len(pairs) > 0 {
		var run []copyPair
		for need := share; need > 0 && len(pairs) > 0; {
			c := pairs[0]
			if len(c.src) <= need {
				run = append(run, c)
				pairs = pairs[1:]
				need -= len(c.src)
				continue
			}
			run = append(run, copyPair{c.dst[:need], c.src[:need]}) // cut: its first need bytes in this run
			pairs[0] = copyPair{c.dst[need:], c.src[need:]}
			need = 0
		}
		wg.Go(func() {
			for _, c := range run {
				copy(c.dst, c.src)
			}
		})
	}
	wg.Wait()
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
func (t *conn) pullRanges(ranges []verify.Range, out []byte) (done bool, err error) {
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
	if err := vmCopy(t.lease.pid, t.iovLocal, t.iovRemote, false); err != nil {
		return false, fmt.Errorf("%w: reading back from the receiving process: %v", errs.Peer, err)
	}
	if mapped && exited(t.lease.pidfd) { // as for a push: its pages outlive it here
		return false, fmt.Errorf("%w: the receiving process %d has exited", errs.Peer, t.lease.pid)
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
			if processVMRead(t.lease.pid, uint64(t.iovRemote[i].Base)+uint64(n-len(dstTail)), dstTail) != nil {
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
func (t *conn) pushFirst(ctx context.Context, descs []verify.Desc) (done bool, err error) {
	if len(t.owed) > 0 || time.Since(t.peekedAt) >= peekEvery {
		if err := t.begin(ctx); err != nil {
			return false, err
		}
	}
	return t.push(ctx, descs)
}

// parallelMin is the batch from which a push is split over several
// threads: the kernel pins the target's pages in every call, so one thread
// copies at about half of memcpy's speed, and the target's CPU takes no
// part. Below it a thread hand-off costs more than it saves.
const parallelMin = 4 << 20

// vmCopyParallel writes the pairs with vmCopy, cut by bytes into
// contiguous runs (a pair may be cut in two) over up to GOMAXPROCS (at
// most 4) goroutines where the batch is large; the first error wins.
// copyParallel cuts memcpy pairs the same way.
func vmCopyParallel(pid int, local []unix.Iovec, remote []unix.RemoteIovec, total uint64) error {
	k := min(runtime.GOMAXPROCS(0), 4)
	if total < parallelMin || k < 2 {
		return vmCopy(pid, local, remote, true)
	}
	results := make(chan error, k)
	runs := 0
	share := int((total + uint64(k) - 1) / uint64(k))
	for len(local) > 0 {
		var l []unix.Iovec
		var r []unix.RemoteIovec
		for need := share; need > 0 && len(local) > 0; {
			n := int(local[0].Len)
			if n <= need {
				l, r = append(l, local[0]), append(r, remote[0])
				local, remote = local[1:], remote[1:]
				need -= n
				continue
			}
			// Cut the pair: its first need bytes go in this run.
			head := local[0]
			head.SetLen(need)
			l, r = append(l, head), append(r, unix.RemoteIovec{Base: remote[0].Base, Len: need})
			local[0].Base = (*byte)(unsafe.Add(unsafe.Pointer(local[0].Base), need))
			local[0].SetLen(n - need)
			remote[0].Base += uintptr(need)
			remote[0].Len -= need
			need = 0
		}
		runs++
		go func() { results <- vmCopy(pid, l, r, true) }()
	}
	var first error
	for ; runs > 0; runs-- {
		if err := <-results; err != nil && first == nil {
			first = err
		}
	}
	return first
}
