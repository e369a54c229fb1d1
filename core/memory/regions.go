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
	"unsafe"

	"github.com/mcguard/mcguard/core/cuda"
	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/verify"
)

// Region is a span of process memory that the application registered.
type Region struct {
	Addr uint64 `json:"addr"`
	Len  uint64 `json:"len"`
}

// region is a registered Region, where its bytes live, and the accesses
// in progress on it.
type region struct {
	Region
	mem  cuda.Memory // Device: reached through the driver's staging copies
	pins *pins
	nth  uint64 // when it was registered, among the table's registrations
}

// pins counts a region's accesses in progress, so that Remove can wait for
// them without the table's lock: an access that waits on a peer (a payload
// still arriving, a reply the peer does not read) holds its region only,
// never the table, and Remove cuts it off through its abort function.
type pins struct {
	mu      sync.Mutex
	n       int
	next    uint64
	aborts  map[uint64]func()
	removed bool
	idle    *sync.Cond // signalled when n drops to 0
}

func newPins() *pins {
	p := &pins{aborts: map[uint64]func(){}}
	p.idle = sync.NewCond(&p.mu)
	return p
}

func (p *pins) enter(abort func()) uint64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.n++
	p.next++
	if abort != nil {
		p.aborts[p.next] = abort
	}
	return p.next
}

func (p *pins) leave(id uint64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	delete(p.aborts, id)
	if p.n--; p.n == 0 {
		p.idle.Broadcast()
	}
}

// drain cuts off the accesses that can be cut and waits for all of them.
func (p *pins) drain() {
	p.mu.Lock()
	p.removed = true
	aborts := make([]func(), 0, len(p.aborts))
	for _, a := range p.aborts {
		aborts = append(aborts, a)
	}
	p.mu.Unlock()
	for _, a := range aborts {
		a()
	}
	p.mu.Lock()
	for p.n > 0 {
		p.idle.Wait()
	}
	p.mu.Unlock()
}

// End is the first address past r.
func (r Region) End() uint64 { return r.Addr + r.Len }

// Contains reports whether [addr, addr+n) lies inside r; n > 0 and the
// range must not wrap.
func (r Region) Contains(addr, n uint64) bool {
	return n > 0 && addr+n >= addr && addr >= r.Addr && addr+n <= r.End()
}

// Overlaps reports whether r and o share a byte.
func (r Region) Overlaps(o Region) bool { return r.Addr < o.End() && o.Addr < r.End() }

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

// within runs fn on the region holding [addr, addr+n) with the region
// pinned, so that it cannot be unregistered meanwhile; abort, if not nil,
// cuts fn short when it is (it closes the connection fn waits on).
func (t *Regions) within(addr, n uint64, abort func(), fn func(mem cuda.Memory) error) error {
	h, mem, err := t.hold(addr, n, abort)
	if err != nil {
		return err
	}
	defer h.Release()
	return fn(mem)
}

// Pin holds the region of [addr, addr+n) registered until release is
// called (Unregister waits for it; abort, if not nil, is called to cut it
// short), and says where its bytes live.
func (t *Regions) Pin(addr, n uint64, abort func()) (release func(), mem cuda.Memory, err error) {
	h, mem, err := t.hold(addr, n, abort)
	if err != nil {
		return nil, mem, err
	}
	var once sync.Once
	return func() { once.Do(h.Release) }, mem, nil
}

// Held is a region held registered by Hold: Pin without a closure, for
// hot paths that release many at once. Release it exactly once.
type Held struct {
	p  *pins
	id uint64
}

// Hold is Pin returning a Held instead of a release function.
func (t *Regions) Hold(addr, n uint64) (Held, cuda.Memory, error) { return t.hold(addr, n, nil) }

func (t *Regions) hold(addr, n uint64, abort func()) (Held, cuda.Memory, error) {
	h, _, mem, err := t.HoldRegion(addr, n, abort)
	return h, mem, err
}

// HoldRegion is Hold (abortable) that also says which region it holds,
// so that a run of ranges inside it needs one hold.
func (t *Regions) HoldRegion(addr, n uint64, abort func()) (Held, Region, cuda.Memory, error) {
	t.mu.RLock()
	r := t.findLocked(addr, n)
	if r == nil {
		t.mu.RUnlock()
		return Held{}, Region{}, cuda.Memory{}, fmt.Errorf("%w: [%#x, +%d)", errs.NotRegistered, addr, n)
	}
	p, reg, mem := r.pins, r.Region, r.mem
	id := p.enter(abort)
	t.mu.RUnlock()
	return Held{p: p, id: id}, reg, mem, nil
}

// Release lets go of a Held region.
func (h Held) Release() { h.p.leave(h.id) }

// Load runs fn on the bytes [addr, addr+n) after checking them: host
// memory as it is, device memory as a staged copy. fn must not keep b.
func (t *Regions) Load(addr, n uint64, fn func(b []byte) error) error {
	return t.LoadAbortable(addr, n, nil, fn)
}

// LoadAbortable is Load for an fn that waits on a peer: unregistering the
// region calls abort, which must make fn return.
func (t *Regions) LoadAbortable(addr, n uint64, abort func(), fn func(b []byte) error) error {
	return t.within(addr, n, abort, func(mem cuda.Memory) error { return t.load(mem, addr, n, fn) })
}

// LoadRanges is LoadAbortable for each range in turn, holding a region
// once for the run of ranges inside it: a read-back of thousands of small
// tails pins each region once, not each tail.
func (t *Regions) LoadRanges(addrs, lens []uint64, abort func(), fn func(b []byte) error) error {
	for i := 0; i < len(addrs); {
		h, r, mem, err := t.HoldRegion(addrs[i], lens[i], abort)
		if err != nil {
			return err
		}
		for ; i < len(addrs) && r.Contains(addrs[i], lens[i]) && err == nil; i++ {
			err = t.load(mem, addrs[i], lens[i], fn)
		}
		h.Release()
		if err != nil {
			return err
		}
	}
	return nil
}

// load runs fn on [addr, addr+n) of a held region: host memory as it is,
// device memory as a staged copy.
func (t *Regions) load(mem cuda.Memory, addr, n uint64, fn func(b []byte) error) error {
	if !mem.Device {
		return fn(BytesAt(addr, n))
	}
	buf := make([]byte, n)
	if err := t.gpu.CopyToHost(buf, addr, mem); err != nil {
		return fmt.Errorf("%w: staging [%#x, +%d) from the GPU: %v", errs.Device, addr, n, err)
	}
	return fn(buf)
}

// Store lets fill write all n bytes of [addr, addr+n). Device memory gets
// a buffer that is copied to the GPU after fill returns, and Store returns
// once that copy has completed.
func (t *Regions) Store(addr, n uint64, fill func(b []byte) error) error {
	return t.StoreAbortable(addr, n, nil, fill)
}

// StoreAbortable is Store for a fill that waits on a peer (a payload
// still arriving): unregistering the region calls abort, which must make
// fill return.
func (t *Regions) StoreAbortable(addr, n uint64, abort func(), fill func(b []byte) error) error {
	return t.within(addr, n, abort, func(mem cuda.Memory) error {
		if !mem.Device {
			return fill(BytesAt(addr, n))
		}
		buf := make([]byte, n)
		if err := fill(buf); err != nil {
			return err
		}
		if err := t.gpu.CopyToDevice(addr, buf, mem); err != nil {
			return fmt.Errorf("%w: staging [%#x, +%d) to the GPU: %v", errs.Device, addr, n, err)
		}
		return nil
	})
}

// StoreFromDevice copies n bytes of device memory at src (on srcMem's
// device, e.g. another process's allocation opened by CUDA IPC) into
// [addr, addr+n): device to device, or to host memory, returning once the
// copy has completed.
func (t *Regions) StoreFromDevice(addr, n uint64, abort func(), src uint64, srcMem cuda.Memory) error {
	return t.within(addr, n, abort, func(mem cuda.Memory) error {
		var err error
		if mem.Device {
			err = t.gpu.CopyDeviceToDevice(addr, src, n, mem)
		} else {
			err = t.gpu.CopyToHost(BytesAt(addr, n), src, srcMem)
		}
		if err != nil {
			return fmt.Errorf("%w: copying [%#x, +%d) from the peer's GPU memory: %v", errs.Device, addr, n, err)
		}
		return nil
	})
}

// View returns the bytes [addr, addr+n) for reading: host memory itself
// (valid while the application keeps it registered, as a transfer's
// sources must stay), or a staged copy of device memory.
func (t *Regions) View(addr, n uint64) ([]byte, error) {
	mem, err := t.Memory(addr, n)
	if err != nil {
		return nil, err
	}
	if !mem.Device {
		return BytesAt(addr, n), nil
	}
	return t.Copy(addr, n)
}

// Copy returns a copy of [addr, addr+n) (for small probes).
func (t *Regions) Copy(addr, n uint64) ([]byte, error) {
	var out []byte
	err := t.Load(addr, n, func(b []byte) error { out = append([]byte(nil), b...); return nil })
	return out, err
}

// Digest returns the xxh3-64 of [addr, addr+n), read in pieces of at most
// 4 MiB so device memory never needs a staging copy of its whole length.
func (t *Regions) Digest(addr, n uint64) (uint64, error) {
	mem, err := t.Memory(addr, n)
	if err != nil {
		return 0, err
	}
	if !mem.Device {
		var d uint64
		err := t.Load(addr, n, func(b []byte) error { d = verify.DigestOf(b); return nil })
		return d, err
	}
	h := verify.NewDigester()
	for off := uint64(0); off < n; off += 4 << 20 {
		k := min(4<<20, n-off)
		if err := t.Load(addr+off, k, func(b []byte) error { h.Write(b); return nil }); err != nil {
			return 0, err
		}
	}
	return h.Sum64(), nil
}

// BytesAt views registered memory. The addresses come from the application
// (C or Python buffers, or mmap in tests), never from the Go heap, so the
// garbage collector neither moves nor frees them.
func BytesAt(addr, n uint64) []byte {
	return unsafe.Slice((*byte)(unsafe.Pointer(uintptr(addr))), n)
}

// AddrOf is the address of b's first byte, for memory outside the Go heap
// (mmap) that is handed to C by address.
func AddrOf(b []byte) uint64 { return uint64(uintptr(unsafe.Pointer(unsafe.SliceData(b)))) }

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

// ReachIn is how many bytes there are from addr to the end of the one of
// regions (a peer's table, in any order) holding it: 0 where none does.
func ReachIn(regions []Region, addr uint64) uint64 {
	for _, r := range regions {
		if r.Contains(addr, 1) {
			return r.End() - addr
		}
	}
	return 0
}

// Covers reports whether [addr, addr+n) lies inside one of regions.
func Covers(regions []Region, addr, n uint64) bool {
	for _, r := range regions {
		if r.Contains(addr, n) {
			return true
		}
	}
	return false
}
