package samehost

import (
	"sync"
	"sync/atomic"
	"syscall"
	"unsafe"
)

// How a same-host sender proves it is the process it claims (the target
// reads the nonce back out of its memory), and the count of connections
// that fell back to the socket instead.

// Probe is the page a sender proves itself with: the handshake's nonce,
// written where the target can read it.
type Probe struct{ mem []byte }

// NewProbe maps a page holding nonce.
func NewProbe(nonce []byte) (*Probe, error) {
	mem, err := syscall.Mmap(-1, 0, 4096, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_PRIVATE|syscall.MAP_ANON)
	if err != nil {
		return nil, err
	}
	copy(mem, nonce)
	return &Probe{mem: mem}, nil
}

// Addr is where the page is in this process.
func (p *Probe) Addr() uint64 { return uint64(uintptr(unsafe.Pointer(&p.mem[0]))) }

// Free unmaps the page.
func (p *Probe) Free() { syscall.Munmap(p.mem) }

// Fallbacks counts the connections to a receiver on this host that sent
// their bytes through the socket under same_host "auto", and says why the
// last one did (stats: nothing falls back silently).
type Fallbacks struct {
	n   atomic.Int64
	mu  sync.Mutex
	why string
}

// Count records one more, and why.
func (f *Fallbacks) Count(why string) {
	f.n.Add(1)
	f.mu.Lock()
	f.why = why
	f.mu.Unlock()
}

// Last is how many fell back, and why the last one did.
func (f *Fallbacks) Last() (int64, string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.n.Load(), f.why
}
