// Package memory is the table of registered memory: every byte a guard
// touches, as sender or as target, is checked against it first, and device
// memory is reached only through it (staged copies through the driver).
package memory

import (
	"cmp"
	"fmt"
	"slices"
	"sort"
	"sync"

	"github.com/mcguard/mcguard/core/cuda"
	"github.com/mcguard/mcguard/core/errs"
)

// region is a registered Region, where its bytes live, and the accesses
// in progress on it.
type region struct {
	Region
	mem  cuda.Memory // Device: reached through the driver's staging copies
	pins *pins
	nth  uint64 // when it was registered, among the table's registrations
}

// Regions is the table of registered memory. Every byte the guard touches,
// as sender or as target, is checked against it first, so a peer can never
// read or write memory that was not registered.
type Regions struct {
	gpu  *cuda.Driver // nil: no CUDA here, all memory is host memory
	mu   sync.RWMutex
	list []region // sorted by Addr, non-overlapping
	adds uint64   // registrations so far, to order Snapshot
}

// New returns an empty table; gpu is the CUDA driver device memory is
// reached through, or nil where there is none (all memory is host memory).
func New(gpu *cuda.Driver) *Regions { return &Regions{gpu: gpu} }

// GPU is the driver device memory is reached through, or nil.
func (t *Regions) GPU() *cuda.Driver { return t.gpu }

// Add registers [addr, addr+n), host memory.
func (t *Regions) Add(addr, n uint64) error { return t.AddMemory(addr, n, cuda.Memory{}) }

// AddMemory registers [addr, addr+n) as mem says.
func (t *Regions) AddMemory(addr, n uint64, mem cuda.Memory) error {
	if addr == 0 || n == 0 || addr+n < addr {
		return fmt.Errorf("%w: cannot register address %#x length %d (null, empty or wrapping)", errs.InvalidArg, addr, n)
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	i := sort.Search(len(t.list), func(i int) bool { return t.list[i].Addr >= addr })
	if (i > 0 && t.list[i-1].End() > addr) || (i < len(t.list) && t.list[i].Addr < addr+n) {
		return fmt.Errorf("%w: [%#x, +%d) overlaps a registered region", errs.InvalidArg, addr, n)
	}
	t.list = append(t.list, region{})
	copy(t.list[i+1:], t.list[i:])
	t.adds++
	t.list[i] = region{Region: Region{Addr: addr, Len: n}, mem: mem, pins: newPins(), nth: t.adds}
	return nil
}

// Remove unregisters the region that starts at addr. New accesses fail at
// once; accesses in progress are cut off where they can be (a peer's
// connection closed) and waited for, so none touches the memory after
// Remove returns. Other regions' accesses go on meanwhile.
func (t *Regions) Remove(addr uint64) error {
	t.mu.Lock()
	var gone *pins
	for i, r := range t.list {
		if r.Addr == addr {
			gone = r.pins
			t.list = append(t.list[:i], t.list[i+1:]...)
			break
		}
	}
	t.mu.Unlock()
	if gone == nil {
		return fmt.Errorf("%w: no region registered at %#x", errs.NotRegistered, addr)
	}
	gone.drain()
	return nil
}

// Snapshot returns a copy of the table in registration order: a peer's
// handshake lists them so, and Mooncake's get_first_buffer_address is the
// first registered.
func (t *Regions) Snapshot() []Region {
	t.mu.RLock()
	byAge := slices.Clone(t.list)
	t.mu.RUnlock()
	slices.SortFunc(byAge, func(a, b region) int { return cmp.Compare(a.nth, b.nth) })
	out := make([]Region, len(byAge))
	for i, r := range byAge {
		out[i] = r.Region
	}
	return out
}

// findLocked returns the region holding [addr, addr+n), or nil.
func (t *Regions) findLocked(addr, n uint64) *region {
	i := sort.Search(len(t.list), func(i int) bool { return t.list[i].End() > addr })
	if i < len(t.list) && t.list[i].Contains(addr, n) {
		return &t.list[i]
	}
	return nil
}

// Memory says where the registered bytes at addr live.
func (t *Regions) Memory(addr, n uint64) (cuda.Memory, error) {
	t.mu.RLock()
	defer t.mu.RUnlock()
	r := t.findLocked(addr, n)
	if r == nil {
		return cuda.Memory{}, fmt.Errorf("%w: [%#x, +%d)", errs.NotRegistered, addr, n)
	}
	return r.mem, nil
}

// Check reports whether [addr, addr+n) lies inside one registered region.
func (t *Regions) Check(addr, n uint64) error {
	_, err := t.Memory(addr, n)
	return err
}

// CheckRanges is Check for each range, under one read lock, looking a
// region up again only where a range leaves the previous one's: it
// returns the index of the first range outside registered memory, or -1.
func (t *Regions) CheckRanges(addrs, lens []uint64) int {
	t.mu.RLock()
	defer t.mu.RUnlock()
	var r *region
	for i := range addrs {
		if r == nil || !r.Contains(addrs[i], lens[i]) {
			if r = t.findLocked(addrs[i], lens[i]); r == nil {
				return i
			}
		}
	}
	return -1
}

// Devices returns the device ordinals of the registered regions that
// ranges touch.
func (t *Regions) Devices(ranges []Region) []int {
	t.mu.RLock()
	defer t.mu.RUnlock()
	seen := map[int]bool{}
	var out []int
	for _, rg := range ranges {
		if r := t.findLocked(rg.Addr, rg.Len); r != nil && r.mem.Device && !seen[r.mem.Ordinal] {
			seen[r.mem.Ordinal] = true
			out = append(out, r.mem.Ordinal)
		}
	}
	return out
}

// HostReach is how many bytes there are from addr to the end of the
// registered host-memory region holding it: 0 where none does, or where
// it is device memory (a device region may span allocations, which one
// copy cannot cross).
func (t *Regions) HostReach(addr uint64) uint64 {
	t.mu.RLock()
	defer t.mu.RUnlock()
	if r := t.findLocked(addr, 1); r != nil && !r.mem.Device {
		return r.End() - addr
	}
	return 0
}
