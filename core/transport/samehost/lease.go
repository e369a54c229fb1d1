package samehost

import (
	"context"
	"crypto/rand"
	"fmt"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/mcguard/mcguard/core/logs"
)

// The lease file: how a same-host sender may write into the target's
// registered host memory itself (process_vm_writev; LeaseHolder) while the
// target still honours unregister, quiesce and abort without its CPU
// taking part in the writes. It is a small shared memory file (memfd) the
// target creates; a sender that proved it is the sending process takes a
// copy of its descriptor from the target with pidfd_getfd, which needs the
// same permission as writing the target's memory, and maps it.
//
// What it holds, all 8-byte words:
//   - gen: even while the table is stable; odd while the target changes it.
//     Every unregister, quiesce, settle and abort raises it.
//   - quiesce: the target's newest quiesce generation, stored before it
//     waits for writers: a sender whose transfer began under an older one
//     stops writing itself and sends the rest through the socket, where
//     the target refuses what falls into the quiesced ranges.
//   - the table: the target's registered host regions (address, length),
//     and for one inside a shared allocation (core/transport/samehost) the
//     allocation's address, size, descriptor and inode, for the sender to
//     map it and copy with memcpy instead of process_vm_writev.
//   - a slot per data connection: busy, the gen+1 its sender entered under
//     (0: not writing), and owner, the epoch the target handed the slot
//     out under (0 once it took it back: the connection ended or was
//     aborted). A sender whose epoch is not the slot's owner writes
//     nothing, so a slot given to a new connection is never the old one's.
//     Then the head and tail of the slot's notice ring, and a refusal of
//     one of its notices (notice_ring.go).
//   - a notice ring per slot, after the slots.
//
// A sender stores busy = g+1, then loads gen (and owner): if gen is still
// g (even) and owner is its epoch, it checks its destinations against the
// table, loads gen once more (a change means the table moved under it:
// start again), writes, and stores busy = 0. A target that removes a
// region (or quiesces) changes the table, raises gen to g', and then waits
// until no slot's busy names an older gen. These are sequentially
// consistent atomics on both sides, so either the sender saw the new gen
// (and the new table), or the target saw its busy and waited: a write into
// an unregistered region can never begin after Unregister returns.
//
// This protects against a sender that keeps to it. A process with ptrace
// access can write anywhere in the target anyway; the pull path's proof
// (tcp's same-host handshake) is what stops anyone else from getting a slot.

const (
	leaseNonceSize  = 16
	leaseGenOff     = 16
	leaseCountOff   = 24
	leaseQuiesceOff = 32 // the target's newest quiesce generation
	leaseTableOff   = 64
	maxLeaseRegions = 1024 // registered host regions past it are written through the socket
	leaseEntrySize  = 48   // addr, n, then base, size, fd, ino of a shared allocation (ino 0: none)
	leaseSlotsOff   = leaseTableOff + leaseEntrySize*maxLeaseRegions
	leaseSlotSize   = 64 // a cache line each: senders do not share lines
	// MaxLeaseSlots bounds the connections that may write here at once.
	MaxLeaseSlots = 1024
	leaseRingsOff = (leaseSlotsOff + leaseSlotSize*MaxLeaseSlots + 4095) &^ 4095
	leaseSize     = leaseRingsOff + ringSize*MaxLeaseSlots // pages of a ring never used are never allocated
)

// leaseWords addresses a mapped lease file's words (both ends).
type leaseWords []byte

func (m leaseWords) word(off int) *uint64 { return (*uint64)(unsafe.Pointer(&m[off])) }

func (m leaseWords) gen() *uint64   { return m.word(leaseGenOff) }
func (m leaseWords) count() *uint64 { return m.word(leaseCountOff) }

// quiesce is the target's newest quiesce generation: a sender's transfer
// that began before it writes through the socket from then on.
func (m leaseWords) quiesce() *uint64 { return m.word(leaseQuiesceOff) }
func (m leaseWords) entry(i int) (a, n *uint64) {
	return m.field(i, 0), m.field(i, 1)
}

// field is word k of table entry i.
func (m leaseWords) field(i, k int) *uint64 { return m.word(leaseTableOff + leaseEntrySize*i + 8*k) }
func (m leaseWords) busy(slot int) *uint64  { return m.word(leaseSlotsOff + leaseSlotSize*slot) }
func (m leaseWords) owner(slot int) *uint64 { return m.word(leaseSlotsOff + leaseSlotSize*slot + 8) }

// ringHead is how many bytes the slot's sender has put in its notice ring
// (it writes it); ringTail how many the target has taken (it writes it).
func (m leaseWords) ringHead(slot int) *uint64 {
	return m.word(leaseSlotsOff + leaseSlotSize*slot + 16)
}
func (m leaseWords) ringTail(slot int) *uint64 {
	return m.word(leaseSlotsOff + leaseSlotSize*slot + 24)
}

// ringRefused is the id of a notice from the ring that the target refused
// and the sender has not yet been told of (0: none; the target writes it,
// the sender clears it).
func (m leaseWords) ringRefused(slot int) *uint64 {
	return m.word(leaseSlotsOff + leaseSlotSize*slot + 32)
}

// ring is the slot's notice ring.
func (m leaseWords) ring(slot int) []byte {
	off := leaseRingsOff + ringSize*slot
	return m[off : off+ringSize : off+ringSize]
}

// leaseSlot is the target's record of a slot it handed out.
type leaseSlot struct {
	used   bool
	sender string
	pidfd  int // the sender process, to tell a dead writer from a slow one
}

// Lease is the target's side of the lease file.
type Lease struct {
	mem     leaseWords
	fd      int
	nonce   [leaseNonceSize]byte
	timeout time.Duration

	mu    sync.Mutex // table changes and slot records
	epoch uint64     // the last slot owner handed out
	table []regionEntry
	slots [MaxLeaseSlots]leaseSlot
	inUse atomic.Int32 // slots handed out
	upTo  atomic.Int32 // slots past it were never handed out: waits look no further
}

// regionEntry is a table entry; shared the allocation it lies in, if any.
type regionEntry struct {
	addr, n uint64
	shared  SharedFile
}

// NewLease creates the lease file; timeout bounds each wait for writers.
func NewLease(timeout time.Duration) (*Lease, error) {
	fd, err := unix.MemfdCreate("mcguard-lease", unix.MFD_CLOEXEC)
	if err != nil {
		return nil, err
	}
	if err := unix.Ftruncate(fd, leaseSize); err != nil {
		unix.Close(fd)
		return nil, err
	}
	mem, err := unix.Mmap(fd, 0, leaseSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		unix.Close(fd)
		return nil, err
	}
	l := &Lease{mem: mem, fd: fd, timeout: timeout}
	rand.Read(l.nonce[:])
	copy(mem, l.nonce[:])
	for i := range l.slots {
		l.slots[i].pidfd = -1
	}
	return l, nil
}

// Close empties the table and revokes every slot, so that senders, which
// keep their own mapping of the file, write nothing more into this
// process (its memory may be freed once the guard is closed), waits for
// writes in progress, and lets go of the file.
func (l *Lease) Close() {
	l.mu.Lock()
	for i := range l.slots {
		atomic.StoreUint64(l.mem.owner(i), 0)
	}
	g := l.changeLocked(func() { l.table = nil })
	l.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), l.timeout)
	defer cancel()
	if err := l.waitOlder(ctx, g, ""); err != nil {
		logs.Printf(logs.Warn, "closing: %v", err)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	for i := range l.slots {
		if l.slots[i].pidfd >= 0 {
			unix.Close(l.slots[i].pidfd)
		}
	}
	unix.Munmap(l.mem)
	unix.Close(l.fd)
}

// changeLocked runs fn on the table between two raises of gen (odd
// meanwhile: senders wait) and returns the even gen after it.
func (l *Lease) changeLocked(fn func()) uint64 {
	atomic.AddUint64(l.mem.gen(), 1)
	fn()
	atomic.StoreUint64(l.mem.count(), uint64(len(l.table)))
	for i, e := range l.table {
		for k, v := range [...]uint64{e.addr, e.n, e.shared.Addr, e.shared.Len, uint64(e.shared.FD), e.shared.Ino} {
			atomic.StoreUint64(l.mem.field(i, k), v)
		}
	}
	return atomic.AddUint64(l.mem.gen(), 1)
}

// Add puts a registered host region in the table, with the shared
// allocation it lies in (Ino 0: none); past maxLeaseRegions it is left
// out, and senders write into it through the socket.
func (l *Lease) Add(addr, n uint64, shared SharedFile) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.table) >= maxLeaseRegions {
		return
	}
	l.changeLocked(func() { l.table = append(l.table, regionEntry{addr, n, shared}) })
}

// Remove takes the region at addr out of the table and waits until no
// sender can still be writing into it.
func (l *Lease) Remove(addr uint64) error {
	l.mu.Lock()
	i := -1
	for k, e := range l.table {
		if e.addr == addr {
			i = k
		}
	}
	if i < 0 {
		l.mu.Unlock()
		return nil
	}
	g := l.changeLocked(func() { l.table = append(l.table[:i], l.table[i+1:]...) })
	l.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), l.timeout)
	defer cancel()
	return l.waitOlder(ctx, g, "")
}

// Quiesced publishes quiesce generation g to the senders.
func (l *Lease) Quiesced(g uint64) {
	for {
		old := atomic.LoadUint64(l.mem.quiesce())
		if g <= old || atomic.CompareAndSwapUint64(l.mem.quiesce(), old, g) {
			return
		}
	}
}

// Settle raises gen and waits for the writers that entered before: after
// it, no same-host write that began earlier is still landing.
func (l *Lease) Settle(ctx context.Context) error {
	if l.inUse.Load() == 0 {
		return nil // no slot handed out: nobody can have begun a write (every receiver sync comes here)
	}
	return l.waitOlder(ctx, l.raise(), "")
}

// raise moves gen on by two, the table unchanged, and returns it.
func (l *Lease) raise() uint64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return atomic.AddUint64(l.mem.gen(), 2)
}

// Revoke stops sender's connections from writing (their next write finds
// its slot without an owner) and waits for a write of theirs in progress.
func (l *Lease) Revoke(ctx context.Context, sender string) error {
	l.mu.Lock()
	for i := range l.slots {
		if l.slots[i].used && l.slots[i].sender == sender {
			atomic.StoreUint64(l.mem.owner(i), 0)
		}
	}
	l.mu.Unlock()
	return l.waitOlder(ctx, l.raise(), sender)
}

// waitOlder waits until no slot (of sender, if not "") is busy under a gen
// older than g, or its process has exited.
func (l *Lease) waitOlder(ctx context.Context, g uint64, sender string) error {
	pause := 20 * time.Microsecond
	for i := 0; i < int(l.upTo.Load()); i++ {
		for {
			b := atomic.LoadUint64(l.mem.busy(i))
			if b == 0 || b-1 >= g {
				break
			}
			l.mu.Lock()
			s := l.slots[i]
			l.mu.Unlock()
			if (sender != "" && s.sender != sender) || !s.used || exited(s.pidfd) {
				break
			}
			select {
			case <-ctx.Done():
				return fmt.Errorf("a same-host sender (slot %d) is still writing into this process: %w", i, ctx.Err())
			case <-time.After(pause):
			}
			pause = min(2*pause, time.Millisecond)
		}
	}
	return nil
}

// Assign hands a slot to a connection of sender, process pid, under a new
// epoch; slot -1 where none is free (it writes through the socket, or the
// target pulls).
func (l *Lease) Assign(sender string, pid int) (slot int, epoch uint64) {
	pidfd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return -1, 0
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	for i := range l.slots {
		if !l.slots[i].used && atomic.LoadUint64(l.mem.busy(i)) == 0 {
			l.epoch++
			atomic.StoreUint64(l.mem.ringHead(i), 0) // no sender writes it: the slot has no owner
			atomic.StoreUint64(l.mem.ringTail(i), 0)
			atomic.StoreUint64(l.mem.ringRefused(i), 0)
			atomic.StoreUint64(l.mem.owner(i), l.epoch)
			l.slots[i] = leaseSlot{used: true, sender: sender, pidfd: pidfd}
			l.inUse.Add(1)
			l.upTo.Store(max(l.upTo.Load(), int32(i+1)))
			return i, l.epoch
		}
	}
	unix.Close(pidfd)
	return -1, 0
}

// Release takes a slot back when its connection ends: no owner, and free
// again once no write under it is in progress, after drain (the caller's:
// it takes the notices left in the slot's ring, which nobody writes any
// more). A writer that does not finish in time keeps its slot, logged
// (bounded by MaxLeaseSlots).
func (l *Lease) Release(slot int, drain func()) {
	l.mu.Lock()
	atomic.StoreUint64(l.mem.owner(slot), 0)
	l.mu.Unlock()
	deadline := time.Now().Add(l.timeout)
	for atomic.LoadUint64(l.mem.busy(slot)) != 0 {
		l.mu.Lock()
		dead := exited(l.slots[slot].pidfd)
		l.mu.Unlock()
		if dead {
			atomic.StoreUint64(l.mem.busy(slot), 0)
			break
		}
		if time.Now().After(deadline) {
			logs.Printf(logs.Warn, "same-host lease slot %d: its sender is still writing %v after its connection ended; the slot stays taken", slot, l.timeout)
			return
		}
		time.Sleep(100 * time.Microsecond)
	}
	if drain != nil {
		drain()
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.slots[slot].pidfd >= 0 {
		unix.Close(l.slots[slot].pidfd)
	}
	l.slots[slot] = leaseSlot{pidfd: -1}
	l.inUse.Add(-1)
}

// Writers counts the slots handed out (connections that may write here).
func (l *Lease) Writers() int { return int(l.inUse.Load()) }

// exited reports whether the process behind pidfd has ended (a pidfd
// polls readable then). A raw poll that cannot block, on the stack: it is
// on every same-host memcpy push.
func exited(pidfd int) bool {
	if pidfd < 0 {
		return false
	}
	pfd := unix.PollFd{Fd: int32(pidfd), Events: unix.POLLIN}
	n, _, errno := unix.RawSyscall(unix.SYS_POLL, uintptr(unsafe.Pointer(&pfd)), 1, 0)
	return errno == 0 && n > 0
}

// FD is the lease file's descriptor in this process (a same-host sender
// takes its own copy with pidfd_getfd); Nonce names the file, for the
// sender to check it took the one the handshake named.
func (l *Lease) FD() int { return l.fd }

// Nonce: see FD.
func (l *Lease) Nonce() []byte { return l.nonce[:] }

// HandedOut counts the slots handed out since the file was made (each
// under a new epoch).
func (l *Lease) HandedOut() uint64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.epoch
}
