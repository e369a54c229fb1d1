package tcp

import (
	"sync"

	"github.com/mcguard/mcguard/core/desc"
	"github.com/mcguard/mcguard/core/wire"
)

// Digests taken as the bytes land (digest mode, the receiver's
// digest_at "landing"): the sender marks each frame of a descriptor with
// the descriptor's length, and the target digests the descriptor's bytes
// right after copying them into place, while they are in cache, so the
// receiver's sync compares instead of reading the memory again. What it
// proves: the bytes this target stored into the descriptor's range, whole
// and in order on the connection that then carried the notice, were the
// sender's, and no later write through this target overlapped them before
// the sync. It does not see a change by anything else (the application, a
// device, another data plane) between landing and sync; digest_at "sync"
// re-reads the memory for that.

// landed is one descriptor's digest, from its first slice on (landing)
// until it is invalidated or evicted.
type landed struct {
	addr, len uint64
	next      uint64 // landing: where the next slice must start
	h         desc.Digester
	digest    uint64
	done      bool // every byte landed and digested
	valid     bool // under landedIndex.mu: no other write overlapped it
	removed   bool // under landedIndex.mu: out of the index
}

// Index bounds: past maxLanded entries, or maxPerBucket in one bucket
// of address space (tiny descriptors packed together: each write scans
// its buckets), the oldest are forgotten and their syncs re-read memory.
// A bucket is 64 KiB: each write scans the entries of the buckets it
// touches, and with 1 MiB buckets a batch of 4 KiB descriptors scanned up
// to 256 entries per write (a third of the target's time at 4096 x 4 KiB).
const (
	maxLanded    = 1 << 16
	maxPerBucket = 64
	maxSlots     = 1 << 20 // bucket entries in all: long descriptors take one per bucket
	bucketShift  = 16
)

// landedIndex finds the entries a write overlaps, to invalidate them.
type landedIndex struct {
	mu      sync.Mutex
	buckets map[uint64][]*landed
	fifo    []*landed // fifo[head:] in age order; the front is reused, not sliced away (a sliding slice reallocated on nearly every append)
	head    int
	slots   int // entries in buckets
	// What would otherwise be allocated per descriptor landing: entries
	// come from slabs, and a bucket's list, emptied, waits for the next
	// bucket to begin (each transfer empties and refills its buckets).
	slab  []landed
	spare [][]*landed
}

// Entries are allocated landedSlab at a time: a slab lives while any of
// its entries is referenced, at most landedSlab x 48 bytes for one that
// outlives the others (maxLanded of them: 50 MiB at worst, where one
// entry each did 3 MiB; in practice entries are released in the order
// they landed).
const (
	landedSlab = 16
	maxSpare   = 1024 // emptied bucket lists kept: up to 512 bytes each
)

// newLocked is a new entry for [addr, addr+n), digested by h.
func (x *landedIndex) newLocked(addr, n uint64, h desc.Digester) *landed {
	if len(x.slab) == 0 {
		x.slab = make([]landed, landedSlab)
	}
	e := &x.slab[0]
	x.slab = x.slab[1:]
	*e = landed{addr: addr, len: n, next: addr, h: h, valid: true}
	return e
}

func buckets(addr, n uint64) (lo, hi uint64) {
	return addr >> bucketShift, (addr + max(n, 1) - 1) >> bucketShift
}

// hashers are the digesters of descriptors landing, reused.
var hashers = sync.Pool{New: func() any { return desc.NewDigester() }}

// begin registers a descriptor about to land at [addr, addr+n).
func (x *landedIndex) begin(addr, n uint64) *landed {
	h := hashers.Get().(desc.Digester)
	h.Reset()
	x.mu.Lock()
	defer x.mu.Unlock()
	e := x.newLocked(addr, n, h)
	if x.buckets == nil {
		x.buckets = map[uint64][]*landed{}
	}
	lo, hi := buckets(addr, n)
	for b := lo; b <= hi; b++ {
		list := x.buckets[b]
		if len(list) >= maxPerBucket {
			x.removeLocked(list[0]) // the oldest there (removal keeps the rest roughly in age order)
			list = x.buckets[b]
		}
		if list == nil && len(x.spare) > 0 {
			list, x.spare = x.spare[len(x.spare)-1], x.spare[:len(x.spare)-1]
		}
		x.buckets[b] = append(list, e)
		x.slots++
	}
	x.fifo = append(x.fifo, e)
	for len(x.fifo)-x.head > maxLanded || x.slots > maxSlots || x.head < len(x.fifo) && x.fifo[x.head].removed {
		x.removeLocked(x.fifo[x.head])
		x.fifo[x.head] = nil
		x.head++
	}
	if x.head > len(x.fifo)/2 { // compact in place
		k := copy(x.fifo, x.fifo[x.head:])
		clear(x.fifo[k:])
		x.fifo, x.head = x.fifo[:k], 0
	}
	return e
}

// removeLocked forgets e: it is invalid from now on.
func (x *landedIndex) removeLocked(e *landed) {
	if e.removed {
		return
	}
	e.valid, e.removed = false, true
	lo, hi := buckets(e.addr, e.len)
	for b := lo; b <= hi; b++ {
		list := x.buckets[b]
		for i, o := range list {
			if o == e {
				list[i] = list[len(list)-1]
				list = list[:len(list)-1]
				x.slots--
				break
			}
		}
		if len(list) == 0 {
			delete(x.buckets, b)
			if len(x.spare) < maxSpare && cap(list) > 0 && cap(list) <= maxPerBucket {
				clear(list[:cap(list)]) // keeps no removed entry alive
				x.spare = append(x.spare, list)
			}
		} else {
			x.buckets[b] = list
		}
	}
}

// wrote invalidates every entry [addr, addr+n) overlaps but self (the
// descriptor this write belongs to). It is called before the bytes are
// stored, so no sync can take an entry for bytes being overwritten.
func (x *landedIndex) wrote(addr, n uint64, self *landed) {
	if n == 0 {
		return
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	if len(x.buckets) == 0 {
		return
	}
	lo, hi := buckets(addr, n)
	for b := lo; b <= hi; b++ {
		list := x.buckets[b] // one map lookup per bucket, not per entry
		for i := 0; i < len(list); i++ {
			if e := list[i]; e != self && e.addr < addr+n && addr < e.addr+e.len {
				x.removeLocked(e)
				list = x.buckets[b]
				i-- // removeLocked moved the last entry here
			}
		}
	}
}

// forgetAll invalidates every entry (a region was unregistered: its
// memory may be reused).
func (x *landedIndex) forgetAll() {
	x.mu.Lock()
	defer x.mu.Unlock()
	for _, e := range x.fifo[x.head:] {
		x.removeLocked(e)
	}
	x.fifo, x.head = nil, 0
	clear(x.buckets)
	x.slots = 0
}

// digestOf returns e's digest if it landed whole and is still valid.
func (x *landedIndex) digestOf(e *landed) (uint64, bool) {
	x.mu.Lock()
	defer x.mu.Unlock()
	return e.digest, e.done && e.valid
}

// landedSet is what a notice carries: the descriptors that landed on its
// connection since the connection's previous notice (transport.Landed).
type landedSet struct {
	x       *landedIndex
	entries []*landed      // in landing order
	byAddr  map[uint64]int // entries' places by address, made at the first search of a large set; a small one is scanned
}

// setScanMax: a set of at most this many entries is scanned.
const setScanMax = 32

func (s *landedSet) Digest(addr, n uint64) (uint64, int, bool) {
	at := -1
	if s.byAddr == nil && len(s.entries) > setScanMax {
		// Asked out of order (DigestAt serves the sync's usual order): a
		// map from here on. A set is settled by one sync, on one goroutine.
		s.byAddr = make(map[uint64]int, len(s.entries))
		for k, e := range s.entries {
			s.byAddr[e.addr] = k // a later landing at the same address wins
		}
	}
	if s.byAddr != nil {
		if k, ok := s.byAddr[addr]; ok {
			at = k
		}
	} else {
		for i := len(s.entries) - 1; i >= 0; i-- { // a later landing at the same address wins
			if s.entries[i].addr == addr {
				at = i
				break
			}
		}
	}
	if at < 0 || s.entries[at].len != n {
		return 0, -1, false
	}
	d, ok := s.x.digestOf(s.entries[at])
	return d, at, ok
}

// DigestAt answers for entry k. An entry at the same address that landed
// later would have invalidated it (wrote), so a valid one is the latest.
func (s *landedSet) DigestAt(k int, addr, n uint64) (uint64, bool, bool) {
	if k < 0 || k >= len(s.entries) || s.entries[k].addr != addr || s.entries[k].len != n {
		return 0, false, false
	}
	d, ok := s.x.digestOf(s.entries[k])
	return d, true, ok
}

func (s *landedSet) Len() int { return len(s.entries) }

// Release takes the set's entries out of the index once their sync
// compared them: the index then holds only what awaits a sync, and each
// write scans little.
func (s *landedSet) Release() {
	s.x.mu.Lock()
	defer s.x.mu.Unlock()
	for _, e := range s.entries {
		s.x.removeLocked(e)
	}
}

// Marks: a request frame's Status carries, for a write of a descriptor
// to digest as it lands, the descriptor's length shifted left by one and,
// in bit 0, whether this is its first slice. 0: not marked.
func mark(descLen uint64, first bool) wire.Status {
	if descLen == 0 || descLen >= 1<<30 {
		return 0
	}
	m := uint32(descLen) << 1
	if first {
		m |= 1
	}
	return wire.Status(m)
}

func unmark(s wire.Status) (descLen uint64, first bool) {
	return uint64(uint32(s) >> 1), uint32(s)&1 != 0
}

// beforeStore, on a write about to be stored, invalidates the digests it
// overlaps and returns the descriptor it lands for, if it is marked.
func (t *target) beforeStore(l *link, addr, n uint64, m wire.Status) *landed {
	if t.landed == nil {
		return nil
	}
	var run *landed
	// only a descriptor inside registered memory: a peer's marks cannot
	// make the index cover address space it may not write
	if descLen, first := unmark(m); descLen > 0 && (!first || t.regions.Check(addr, descLen) == nil) {
		run = l.land.before(t.landed, addr, descLen, first)
	}
	t.landed.wrote(addr, n, run)
	return run
}

// fillDigesting is src's fill, digesting the bytes into run as they are
// stored (in cache now: the receiver's sync need not read them again).
func (t *target) fillDigesting(l *link, run *landed, addr uint64, src source) func([]byte) error {
	if run == nil {
		return src.fill
	}
	return func(b []byte) error {
		if err := src.fill(b); err != nil {
			return err
		}
		l.land.digest(run, addr, b)
		return nil
	}
}

// afterStore completes a marked write's descriptor if it was its last
// slice and its store succeeded; else the descriptor is abandoned (its
// sync re-reads).
func (t *target) afterStore(l *link, run *landed, err error) {
	switch {
	case run == nil:
	case err != nil:
		l.land.abandon()
	default:
		l.land.finish(t.landed, run)
	}
}

// maxLandedPerNotice bounds what a connection collects between notices.
const maxLandedPerNotice = 2 * wire.MaxNoticeDescs

// landing is a connection's digests taken as bytes land.
type landing struct {
	run  *landed   // the descriptor landing now
	done []*landed // landed whole since the last notice
	last int       // how many the last notice took: done's room, made once per notice
}

// before is called before a marked slice at addr of a descriptor of
// descLen bytes is stored: the descriptor it belongs to (a new one at its
// first slice), or nil where it does not continue the one landing.
func (l *landing) before(x *landedIndex, addr, descLen uint64, first bool) *landed {
	switch {
	case first:
		l.run = x.begin(addr, descLen)
	case l.run == nil || l.run.next != addr || l.run.len != descLen:
		l.run = nil
	}
	return l.run
}

// digest adds slice b, just stored at addr (host memory, or the buffer
// a GPU copy takes), to e.
func (l *landing) digest(e *landed, addr uint64, b []byte) {
	n := uint64(len(b))
	if l.run != e || e.next != addr || addr+n > e.addr+e.len {
		l.run = nil
		return
	}
	e.h.Write(b)
	e.next += n
}

// finish, after slice's store succeeded, completes e at its last slice.
func (l *landing) finish(x *landedIndex, e *landed) {
	if l.run != e || e.next != e.addr+e.len {
		return
	}
	x.mu.Lock()
	e.digest, e.done = e.h.Sum64(), true
	x.mu.Unlock()
	hashers.Put(e.h)
	e.h = nil
	if l.done == nil {
		l.done = make([]*landed, 0, max(l.last, 1))
	}
	l.done = append(l.done, e)
	if len(l.done) > maxLandedPerNotice {
		l.done = l.done[1:]
	}
	l.run = nil
}

// abandon drops the descriptor landing now (a refused or device write).
func (l *landing) abandon() { l.run = nil }

// take hands what landed to a notice.
func (l *landing) take(x *landedIndex) *landedSet {
	s := &landedSet{x: x, entries: l.done}
	l.done, l.last = nil, len(s.entries)
	return s
}
