package core

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/core/memory"
)

func TestPeerRegionsAreListedInRegistrationOrderAndKeptCurrent(t *testing.T) {
	p := newPair(t, "", "", 1<<16)
	// Registered after dst, at lower and higher addresses: order is by age.
	low, high := newMem(t, 4096), newMem(t, 8192)
	first, second := high, low
	if low.addr(0) > high.addr(0) {
		first, second = low, high
	}
	require.NoError(t, p.recv.Register(first.addr(0), uint64(len(first.b))))
	got, err := p.send.PeerRegions(p.recv.Endpoint())
	require.NoError(t, err)
	require.Equal(t, []memory.Region{{Addr: p.dst.addr(0), Len: 1 << 16}, {Addr: first.addr(0), Len: uint64(len(first.b))}}, got)

	// A later call sees registrations made since, and unregistrations.
	require.NoError(t, p.recv.Register(second.addr(0), uint64(len(second.b))))
	require.NoError(t, p.recv.Unregister(p.dst.addr(0)))
	got, err = p.send.PeerRegions(p.recv.Endpoint())
	require.NoError(t, err)
	require.Equal(t, []memory.Region{{Addr: first.addr(0), Len: uint64(len(first.b))}, {Addr: second.addr(0), Len: uint64(len(second.b))}}, got)

	_, err = p.send.PeerRegions("not a session")
	require.ErrorIs(t, err, errs.InvalidArg)
	_, err = p.send.PeerRegions("127.0.0.1:1")
	require.Error(t, err)
}
