package tcp

// Same-host writes into a target's shared allocations (core/sharedmem):
// the sender maps each allocation once and copies with memcpy, large
// batches over several goroutines; push.go decides what goes this way.

import (
	"fmt"
	"github.com/mcguard/mcguard/core/desc"
	"sync/atomic"
	"unsafe"

	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/core/logs"
	"github.com/mcguard/mcguard/core/sharedmem"
	"github.com/mcguard/mcguard/core/transport/samehost"
)

// span is the shared allocation (base, size, descriptor and inode in the
// target) that a range lies in; ino 0: none.
type span struct{ base, size, fd, ino uint64 }

func (p *pushLease) spanOf(i int) span {
	return span{atomic.LoadUint64(p.mem.field(i, 2)), atomic.LoadUint64(p.mem.field(i, 3)),
		atomic.LoadUint64(p.mem.field(i, 4)), atomic.LoadUint64(p.mem.field(i, 5))}
}

// mapped is where range i of the last enter lies in this process's
// mapping of the target's shared allocation, or nil (none, or it cannot
// be mapped: logged once, and process_vm_writev takes it). Only between
// enter and exit, when the target cannot free the allocation.
func (p *pushLease) mapped(i int, r desc.Range) []byte {
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

// alive is nil where the target process still exists. After a copy
// through this process's mapping of its memory, whose pages outlive it
// here, that is what shows the copy reached a live receiver.
func (p *pushLease) alive() error {
	if exited(p.pidfd) {
		return fmt.Errorf("%w: the receiving process %d has exited", errs.Peer, p.pid)
	}
	return nil
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

// copyParallel copies the pairs, on several goroutines where the batch is
// large (samehost.InRuns).
func copyParallel(pairs []copyPair, total uint64) {
	k := samehost.Threads(total)
	if k == 1 {
		for _, c := range pairs {
			copy(c.dst, c.src)
		}
		return
	}
	size := func(c copyPair) int { return len(c.src) }
	split := func(c copyPair, n int) (copyPair, copyPair) {
		return copyPair{c.dst[:n], c.src[:n]}, copyPair{c.dst[n:], c.src[n:]}
	}
	samehost.InRuns(pairs, total, k, size, split, func(run []copyPair) error {
		for _, c := range run {
			copy(c.dst, c.src)
		}
		return nil
	})
}
