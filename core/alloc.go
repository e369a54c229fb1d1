package core

import (
	"fmt"

	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/core/memory"
	"github.com/mcguard/mcguard/core/transport/samehost"
)

// Alloc allocates n bytes (whole pages) of zeroed host memory as a shared
// allocation (core/transport/samehost) and registers it. A same-host sender then
// maps it and writes into it with memcpy, and its tail check is a memcmp,
// instead of two cross-memory system calls per transfer. It is freed by
// Free or by Close.
func (g *Guard) Alloc(n uint64) (uint64, error) {
	if err := g.enter(); err != nil {
		return 0, err
	}
	defer g.leave()
	if n == 0 || n > maxAlloc {
		return 0, fmt.Errorf("%w: allocation of %d bytes (1 to %d)", errs.InvalidArg, n, uint64(maxAlloc))
	}
	f, err := samehost.AllocShared(n, g.regions)
	if err != nil {
		return 0, fmt.Errorf("%w: allocating %d bytes: %v", errs.NoMemory, n, err)
	}
	if err := g.Register(f.Addr, f.Len); err != nil {
		f.Free()
		return 0, err
	}
	g.mu.Lock()
	g.allocs[f.Addr] = f
	g.mu.Unlock()
	return f.Addr, nil
}

// maxAlloc bounds one allocation (128 TiB, the user address space).
const maxAlloc = 1 << 47

// Free quiesces and unregisters every registered region in an allocation
// of Alloc (the whole, as Alloc registered it, or what the caller
// registered of it since), then frees it. Where unregistering times out
// (a same-host sender that did not finish its write) the allocation
// stays, and a later Free or Close frees it.
func (g *Guard) Free(addr uint64) error {
	if err := g.enter(); err != nil {
		return err
	}
	defer g.leave()
	g.mu.Lock()
	f := g.allocs[addr]
	delete(g.allocs, addr)
	g.mu.Unlock()
	if f == nil {
		return fmt.Errorf("%w: %#x is not an allocation of this guard (mc_guard_alloc)", errs.InvalidArg, addr)
	}
	whole := memory.Region{Addr: f.Addr, Len: f.Len}
	for _, r := range g.regions.Snapshot() {
		if !r.Overlaps(whole) {
			continue
		}
		err := g.Quiesce([]SyncRange{{Addr: r.Addr, Len: r.Len}})
		if err == nil {
			err = g.Unregister(r.Addr)
		}
		if err != nil {
			g.mu.Lock()
			g.allocs[addr] = f
			g.mu.Unlock()
			return fmt.Errorf("freeing %#x: %w", addr, err)
		}
	}
	return f.Free()
}

// freeAllocs frees every allocation at Close, once no peer can write.
func (g *Guard) freeAllocs() {
	g.mu.Lock()
	allocs := g.allocs
	g.allocs = nil
	g.mu.Unlock()
	for _, f := range allocs {
		f.Free()
	}
}
