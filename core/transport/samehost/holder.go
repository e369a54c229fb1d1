package samehost

import (
	"encoding/hex"
	"errors"
	"fmt"
	"runtime"
	"sync/atomic"

	"golang.org/x/sys/unix"

	"github.com/mcguard/mcguard/core/desc"
	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/core/logs"
)

// mapFallback says, once per process, that a receiver's shared buffer
// could not be mapped.
var mapFallback logs.Once

// LeaseHolder is a sender connection's view of the target's lease file:
// the slot it writes under, and the target's shared allocations it maps.
type LeaseHolder struct {
	mem   leaseWords
	slot  int
	epoch uint64 // the slot's owner while it is this connection's
	// within: a transfer is under way that began under quiesce generation
	// since; a newer one at the target ends this connection's own writes
	// for it (Enter declines).
	within bool
	since  uint64
	pid    int // the target
	pidfd  int // the target process, to see that it was alive when a memcpy into its memory ended

	spans    []span                    // the last Enter's ranges: the shared allocation each lies in
	entries  []int                     // and the table entry (registered region) each lies in
	maps     map[uint64]*SharedMapping // the target's shared allocations mapped here, by inode
	unmapped map[uint64]bool           // inodes that could not be mapped: process_vm_writev
	mapGen   uint64                    // the gen maps were last checked against the table under
}

// AttachLease maps the target's lease file: fd in process pid, checked
// against the handshake's nonce. It returns why not, or "".
func AttachLease(pid, fd int, nonceHex string, slot int, epoch uint64) (*LeaseHolder, string) {
	nonce, err := hex.DecodeString(nonceHex)
	if err != nil || len(nonce) != leaseNonceSize || slot < 0 || slot >= MaxLeaseSlots || fd < 0 {
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
	return &LeaseHolder{mem: mem, slot: slot, epoch: epoch, pid: pid, pidfd: pidfd,
		maps: map[uint64]*SharedMapping{}, unmapped: map[uint64]bool{}}, ""
}

func (p *LeaseHolder) Close() {
	for _, m := range p.maps {
		m.Release()
	}
	clear(p.maps)
	unix.Munmap(p.mem)
	unix.Close(p.pidfd)
}

// ErrRevoked: the target aborted this connection (or it ended there).
var ErrRevoked = errors.New("the receiver revoked this connection's same-host writes")

// maxEnterTries bounds the tries to find the table stable; past them the
// batch goes through the socket.
const maxEnterTries = 64

// Enter marks this slot busy under a stable gen in which every range is in
// the target's table. ok false: write them through the socket instead.
func (p *LeaseHolder) Enter(ranges []desc.Range) (ok bool, err error) {
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
			return false, ErrRevoked
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

func (p *LeaseHolder) Exit() { atomic.StoreUint64(p.mem.busy(p.slot), 0) }

// covers reports whether every range lies inside one region of the
// table, and notes in spans the shared allocation each lies in.
func (p *LeaseHolder) covers(ranges []desc.Range) bool {
	n := min(int(atomic.LoadUint64(p.mem.count())), maxLeaseRegions)
	p.spans, p.entries = p.spans[:0], p.entries[:0]
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
		p.spans, p.entries = append(p.spans, at), append(p.entries, last)
	}
	return true
}

// SameRegion reports whether ranges i and j of the last Enter lie in one
// region of the target's table, so that the bytes between them are the
// target's registered memory too. Only between Enter and Exit.
func (p *LeaseHolder) SameRegion(i, j int) bool { return p.entries[i] == p.entries[j] }

func (p *LeaseHolder) inEntry(i int, r desc.Range) bool {
	a, n := p.mem.entry(i)
	base, size := atomic.LoadUint64(a), atomic.LoadUint64(n)
	return r.Len > 0 && r.Addr >= base && r.Addr+r.Len >= r.Addr && r.Addr+r.Len <= base+size
}

// span is the shared allocation (base, size, descriptor and inode in the
// target) that a range lies in; ino 0: none.
type span struct{ base, size, fd, ino uint64 }

func (p *LeaseHolder) spanOf(i int) span {
	return span{atomic.LoadUint64(p.mem.field(i, 2)), atomic.LoadUint64(p.mem.field(i, 3)),
		atomic.LoadUint64(p.mem.field(i, 4)), atomic.LoadUint64(p.mem.field(i, 5))}
}

// Mapped is where range i of the last Enter lies in this process's
// mapping of the target's shared allocation, or nil (none, or it cannot
// be mapped: logged once, and process_vm_writev takes it). Only between
// Enter and Exit, when the target cannot free the allocation.
func (p *LeaseHolder) Mapped(i int, r desc.Range) []byte {
	s := p.spans[i]
	if s.ino == 0 || p.unmapped[s.ino] || r.Addr < s.base || r.Addr-s.base > s.size || r.Len > s.size-(r.Addr-s.base) {
		return nil
	}
	m := p.maps[s.ino]
	if m == nil {
		var err error
		if m, err = AttachShared(p.pid, int(s.fd), s.ino, s.size); err != nil {
			mapFallback.Printf(logs.Info, "a receiver's shared buffer not mapped (written with process_vm_writev instead): %v", err)
			p.unmapped[s.ino] = true
			return nil
		}
		p.maps[s.ino] = m
	}
	off := r.Addr - s.base
	return m.Mem[off : off+r.Len : off+r.Len]
}

// Alive is nil where the target process still exists. After a copy
// through this process's mapping of its memory, whose pages outlive it
// here, that is what shows the copy reached a live receiver.
func (p *LeaseHolder) Alive() error {
	if exited(p.pidfd) {
		return fmt.Errorf("%w: the receiving process %d has exited", errs.Peer, p.pid)
	}
	return nil
}

// pruneMaps lets go of the mappings (and forgets the failures) of shared
// allocations no longer in the table, so that the target's freed memory
// is freed here too; it runs when the table's gen moved.
func (p *LeaseHolder) pruneMaps() {
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

// Pid is the target process.
func (p *LeaseHolder) Pid() int { return p.pid }

// Quiesce is the target's newest quiesce generation.
func (p *LeaseHolder) Quiesce() uint64 { return atomic.LoadUint64(p.mem.quiesce()) }

// Within says a transfer is under way that began under quiesce generation
// since (within false: none); a newer quiesce at the target ends this
// connection's own writes for it (Enter declines).
func (p *LeaseHolder) Within(within bool, since uint64) { p.within, p.since = within, since }
