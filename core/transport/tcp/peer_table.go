package tcp

// The target's region table as a sender's connections see it, and how far
// a joined write may span within it.

import (
	"sync/atomic"

	"github.com/mcguard/mcguard/core/memory"
)

// peerTable is the region table of a target, from its handshake and the
// newest refresh.
type peerTable struct {
	regions atomic.Pointer[[]memory.Region]
}

func newPeerTable(regions []memory.Region) *peerTable {
	p := &peerTable{}
	p.set(regions)
	return p
}

func (p *peerTable) set(regions []memory.Region) { p.regions.Store(&regions) }

// joinReach is how far a write of joined descriptors may span from src
// and dst: inside the region holding each, here and at the target (a
// frame that crossed into the next region would be refused), and only
// between host memory at both ends: a registered device region may span
// allocations, and one device copy cannot cross from one into the next.
func (t *conn) joinReach(src, dst uint64) uint64 {
	return min(t.local.HostReach(src), t.PeerReach(dst))
}

// PeerReach is how far from dst the target's registered host memory runs
// (transport.PeerReacher): 0 outside its regions, or where the target
// could hold device memory.
func (t *conn) PeerReach(dst uint64) uint64 {
	if !t.hostOnly {
		return 0
	}
	return memory.ReachIn(*t.peer.regions.Load(), dst)
}
