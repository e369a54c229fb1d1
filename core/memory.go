package core

import (
	"fmt"
	"sort"
	"sync"
	"unsafe"
)

// Region is a span of process memory that the application registered.
type Region struct {
	Addr uint64 `json:"addr"`
	Len  uint64 `json:"len"`
}

func (r Region) end() uint64 { return r.Addr + r.Len }

// contains reports whether [addr, addr+n) lies inside r; n > 0 and the
// range must not wrap.
func (r Region) contains(addr, n uint64) bool {
	return n > 0 && addr+n >= addr && addr >= r.Addr && addr+n <= r.end()
}

// Regions is the table of registered memory. Every byte the guard touches,
// as sender or as target, is checked against it first, so a peer can never
// read or write memory that was not registered.
type Regions struct {
	mu   sync.RWMutex
	list []Region // sorted by Addr, non-overlapping
}

// Add registers [addr, addr+n).
func (t *Regions) Add(addr, n uint64) error {
	if addr == 0 || n == 0 || addr+n < addr {
		return fmt.Errorf("%w: cannot register address %#x length %d (null, empty or wrapping)", ErrInvalidArg, addr, n)
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	i := sort.Search(len(t.list), func(i int) bool { return t.list[i].Addr >= addr })
	if (i > 0 && t.list[i-1].end() > addr) || (i < len(t.list) && t.list[i].Addr < addr+n) {
		return fmt.Errorf("%w: [%#x, +%d) overlaps a registered region", ErrInvalidArg, addr, n)
	}
	t.list = append(t.list, Region{})
	copy(t.list[i+1:], t.list[i:])
	t.list[i] = Region{Addr: addr, Len: n}
	return nil
}

// Remove unregisters the region that starts at addr. It waits for accesses
// in progress (they hold the read lock), so none touches freed memory.
func (t *Regions) Remove(addr uint64) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	for i, r := range t.list {
		if r.Addr == addr {
			t.list = append(t.list[:i], t.list[i+1:]...)
			return nil
		}
	}
	return fmt.Errorf("%w: no region registered at %#x", ErrNotRegistered, addr)
}

// Snapshot returns a copy of the table.
func (t *Regions) Snapshot() []Region {
	t.mu.RLock()
	defer t.mu.RUnlock()
	return append([]Region(nil), t.list...)
}

func (t *Regions) findLocked(addr, n uint64) bool {
	i := sort.Search(len(t.list), func(i int) bool { return t.list[i].end() > addr })
	return i < len(t.list) && t.list[i].contains(addr, n)
}

// Check reports whether [addr, addr+n) lies inside one registered region.
func (t *Regions) Check(addr, n uint64) error {
	t.mu.RLock()
	defer t.mu.RUnlock()
	if !t.findLocked(addr, n) {
		return fmt.Errorf("%w: [%#x, +%d)", ErrNotRegistered, addr, n)
	}
	return nil
}

// Access runs fn on the bytes [addr, addr+n) after checking them, holding
// the table's read lock so the region cannot be unregistered meanwhile.
func (t *Regions) Access(addr, n uint64, fn func([]byte) error) error {
	t.mu.RLock()
	defer t.mu.RUnlock()
	if !t.findLocked(addr, n) {
		return fmt.Errorf("%w: [%#x, +%d)", ErrNotRegistered, addr, n)
	}
	return fn(bytesAt(addr, n))
}

// bytesAt views registered memory. The addresses come from the application
// (C or Python buffers, or mmap in tests), never from the Go heap, so the
// garbage collector neither moves nor frees them.
func bytesAt(addr, n uint64) []byte {
	return unsafe.Slice((*byte)(unsafe.Pointer(uintptr(addr))), n)
}

// containsAll reports whether [addr, addr+n) lies inside one of regions.
func containsAll(regions []Region, addr, n uint64) bool {
	for _, r := range regions {
		if r.contains(addr, n) {
			return true
		}
	}
	return false
}
