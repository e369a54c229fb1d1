package engine

import (
	"sync/atomic"

	"github.com/mcguard/mcguard/core/transport"
)

// joins is how a session's writes join consecutive descriptors into
// fewer engine requests (Config.JoinMax): Mooncake's TCP spends tens of
// µs per request, however small, so a cache's consecutive 4 KiB blocks
// cost it more as blocks than as 64 KiB slices.
type joins struct {
	max   uint64
	local func(addr uint64) uint64
	count *atomic.Int64
}

// reach is a session's transport.Cursor Reach: how far a request may
// run from src here and dst at the peer, by this process's regions and
// the peer guard's table (peer). nil, so nothing is joined, where the
// engine's slice is unknown or the peer's table is not at hand.
func (j joins) reach(peer transport.Conn) func(src, dst uint64) uint64 {
	t, ok := peer.(transport.PeerReacher)
	if j.max == 0 || j.local == nil || !ok {
		return nil
	}
	return func(src, dst uint64) uint64 { return min(j.local(src), t.PeerReach(dst)) }
}
