package core

import (
	"slices"

	"github.com/mcguard/mcguard/core/memory"
)

// PeerRegions returns the regions session has registered, in the order it
// registered them, from a fresh handshake (connecting first if need be).
// Mooncake's get_first_buffer_address(session) is the first of them.
func (g *Guard) PeerRegions(name string) ([]memory.Region, error) {
	if err := g.enterSession(name); err != nil {
		return nil, err
	}
	defer g.leave()
	s := g.session(name)
	ctx, c := s.callContext(g.ctx, 0)
	defer s.endCall(c)
	s.mu.Lock()
	defer s.mu.Unlock()
	if g.engine != nil {
		if err := s.refresh(ctx, g); err != nil {
			return nil, callErr(ctx, err)
		}
		return slices.Clone(s.hello.Regions), nil
	}
	if s.conn != nil {
		// It may have registered more, or fewer, since; a connection that
		// cannot refresh (the peer restarted, forgot our token) starts over.
		if err := s.refresh(ctx, g); err != nil {
			s.disconnect()
		}
	}
	if err := s.connect(ctx, g); err != nil {
		return nil, callErr(ctx, err)
	}
	return slices.Clone(s.hello.Regions), nil
}
