package samehost

import (
	"encoding/binary"
	"sync/atomic"
)

// Notice rings: a same-host sender that writes into the target itself
// puts its completion notices in its slot's ring in the lease file rather
// than on the socket. Sending one on the socket woke the target's
// connection goroutine on every transfer (a cross-CPU wake-up, most of a
// small transfer's time), though the notice is needed only when the
// target's application syncs: the target takes a ring's notices then
// (and before any notice that comes on the connection, so they stay in
// order, and when the connection ends).
//
// A ring is ringSize bytes; head (written by the sender) and tail
// (written by the target) count bytes put and taken. A record is its
// length (4 bytes, little-endian), then the notice, padded to 8 bytes; one
// that does not fit before the ring's end is put at its start, behind a
// length of ringWrap. The target trusts nothing in the ring: it keeps its
// own tail, copies each notice out before it decodes it (the notice's MAC
// and sequence number are checked as on the socket), and takes a head or
// a record that does not add up as the end of the ring's notices (they
// are dropped, and the syncs of their transfers fail for want of them).

const (
	ringSize = 16 << 10
	// MaxRingNotice is the longest notice a ring takes (a few hundred
	// descriptors); longer ones go on the socket.
	MaxRingNotice = ringSize/2 - ringLenSize
	ringLenSize   = 4
	ringWrap      = 0xffffffff
)

// ringRecord is the room a notice of n bytes takes.
func ringRecord(n int) uint64 { return uint64(ringLenSize+n+7) &^ 7 }

// PostNotice puts a notice in this connection's ring; false: it did not
// fit (or the slot is not this connection's any more), and the caller
// sends it on the socket. Under busy, as a write: a target that takes
// the slot back waits for it.
func (p *LeaseHolder) PostNotice(body []byte) bool {
	need := ringRecord(len(body))
	if len(body) == 0 || len(body) > MaxRingNotice {
		return false
	}
	busy := p.mem.busy(p.slot)
	g := atomic.LoadUint64(p.mem.gen())
	if g&1 != 0 {
		return false // the target is changing its table: the socket, rather than wait
	}
	atomic.StoreUint64(busy, g+1)
	defer atomic.StoreUint64(busy, 0)
	if atomic.LoadUint64(p.mem.owner(p.slot)) != p.epoch {
		return false
	}
	head, tail := atomic.LoadUint64(p.mem.ringHead(p.slot)), atomic.LoadUint64(p.mem.ringTail(p.slot))
	if tail > head || head-tail > ringSize {
		return false // the target's words do not add up
	}
	ring := p.mem.ring(p.slot)
	pos := head % ringSize
	if ringSize-pos < need { // to the ring's start, behind a wrap mark
		if head-tail+(ringSize-pos)+need > ringSize {
			return false
		}
		binary.LittleEndian.PutUint32(ring[pos:], ringWrap)
		head += ringSize - pos
		pos = 0
	} else if head-tail+need > ringSize {
		return false
	}
	binary.LittleEndian.PutUint32(ring[pos:], uint32(len(body)))
	copy(ring[pos+ringLenSize:], body)
	atomic.StoreUint64(p.mem.ringHead(p.slot), head+need) // after the record: the target reads up to it
	return true
}

// TakeNotices hands each notice in slot's ring to take, in the order they
// were put, from *tail (the caller's own count of what it took, kept
// with the connection and guarded by it) on; buf is scratch for a
// notice's copy (grown as needed, returned). take must not keep body.
// It reports whether the ring added up (false: what was left is dropped).
func (l *Lease) TakeNotices(slot int, tail *uint64, buf []byte, take func(body []byte)) ([]byte, bool) {
	head := atomic.LoadUint64(l.mem.ringHead(slot))
	ring := l.mem.ring(slot)
	ok := true
	for *tail != head {
		if head < *tail || head-*tail > ringSize {
			ok = false
			break
		}
		pos := *tail % ringSize
		n := binary.LittleEndian.Uint32(ring[pos:])
		if n == ringWrap {
			*tail += ringSize - pos
			continue
		}
		need := ringRecord(int(n))
		if n == 0 || n > MaxRingNotice || need > ringSize-pos || need > head-*tail {
			ok = false
			break
		}
		buf = append(buf[:0], ring[pos+ringLenSize:pos+ringLenSize+uint64(n)]...)
		*tail += need
		atomic.StoreUint64(l.mem.ringTail(slot), *tail) // its room is the sender's again
		take(buf)
	}
	if !ok {
		*tail = head
		atomic.StoreUint64(l.mem.ringTail(slot), head)
	}
	return buf, ok
}

// RingPending reports whether slot's ring holds notices not yet taken
// (tail: the caller's count).
func (l *Lease) RingPending(slot int, tail uint64) bool {
	return atomic.LoadUint64(l.mem.ringHead(slot)) != tail
}

// RefuseNotice tells slot's sender that the target refused the ring's
// notice of transfer id (the first such since it last looked).
func (l *Lease) RefuseNotice(slot int, id uint64) {
	if id == 0 {
		id = ^uint64(0) // too short to name one
	}
	atomic.CompareAndSwapUint64(l.mem.ringRefused(slot), 0, id)
}

// TakeRefusal is the id of a notice of this connection's ring that the
// target refused since the last call, or 0.
func (p *LeaseHolder) TakeRefusal() uint64 {
	if atomic.LoadUint64(p.mem.ringRefused(p.slot)) == 0 {
		return 0 // the common case: no write to the shared line
	}
	return atomic.SwapUint64(p.mem.ringRefused(p.slot), 0)
}
