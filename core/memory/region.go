package memory

import (
	"unsafe"
)

// Spans of process memory: a registered region, and the helpers that
// read a table of them or view the bytes at an address.

// Region is a span of process memory that the application registered.
type Region struct {
	Addr uint64 `json:"addr"`
	Len  uint64 `json:"len"`
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
	return n > 0 && addr+n >= addr && ReachIn(regions, addr) >= n
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
