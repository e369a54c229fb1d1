package engine

import (
	"sync"

	"github.com/mcguard/mcguard/core/memory"
)

// lies is what a lying engine (fault.Lie) kept to itself: the bytes of
// writes it never handed to the engine, which it answers reads of the
// same ranges with. A write handed over for real takes back the lies it
// overlaps; past maxLies the oldest is forgotten.
type lies struct {
	mu   sync.Mutex
	kept []lie
}

type lie struct {
	session string
	addr    uint64
	bytes   []byte
}

const maxLies = 4096

// keep records the bytes of [src, src+n) as what session's addr holds.
func (l *lies) keep(session string, addr, src, n uint64) {
	b := append([]byte(nil), memory.BytesAt(src, n)...)
	l.mu.Lock()
	defer l.mu.Unlock()
	l.forgetLocked(session, addr, n)
	l.kept = append(l.kept, lie{session, addr, b})
	if len(l.kept) > maxLies {
		l.kept = l.kept[1:]
	}
}

// forget drops the lies a real write to [addr, addr+n) overlaps.
func (l *lies) forget(session string, addr, n uint64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.forgetLocked(session, addr, n)
}

func (l *lies) forgetLocked(session string, addr, n uint64) {
	out := l.kept[:0]
	for _, k := range l.kept {
		if k.session != session || k.addr >= addr+n || k.addr+uint64(len(k.bytes)) <= addr {
			out = append(out, k)
		}
	}
	clear(l.kept[len(out):])
	l.kept = out
}

// tell overwrites what a read of [addr, addr+len(got)) at session got
// with the bytes the lies say are there.
func (l *lies) tell(session string, addr uint64, got []byte) {
	l.mu.Lock()
	defer l.mu.Unlock()
	end := addr + uint64(len(got))
	for _, k := range l.kept {
		kend := k.addr + uint64(len(k.bytes))
		if k.session != session || k.addr >= end || kend <= addr {
			continue
		}
		from, to := max(k.addr, addr), min(kend, end)
		copy(got[from-addr:to-addr], k.bytes[from-k.addr:to-k.addr])
	}
}
