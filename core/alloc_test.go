package core

import (
	"bytes"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/core/desc"
	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/core/transport/samehost"
	"github.com/mcguard/mcguard/verify"
)

func mapped(t *testing.T, g *Guard) int64 {
	return int64(stats(t, g)["same_host_mapped_bytes"].(float64))
}

// allocated is n bytes of g.Alloc as test memory; g's Close frees it.
func allocated(t testing.TB, g *Guard, n int) *mem {
	t.Helper()
	addr, err := g.Alloc(uint64(n))
	require.NoError(t, err)
	return &mem{b: unsafe.Slice((*byte)(unsafe.Pointer(uintptr(addr))), n)}
}

// newMappedPair is newPair with the receiver's memory from its Alloc.
func newMappedPair(t *testing.T, sendJS, recvJS string, size int) *pair {
	p := &pair{src: newMem(t, size)}
	p.send, p.recv = openGuard(t, sendJS), openGuard(t, recvJS)
	p.dst = allocated(t, p.recv, size)
	require.NoError(t, p.send.Register(p.src.addr(0), uint64(size)))
	p.session = p.recv.Endpoint()
	return p
}

// A same-host sender writes into the receiver's allocation with memcpy in
// every mode, and the bytes are there.
func TestAllocatedMemoryIsWrittenByMemcpy(t *testing.T) {
	p := newMappedPair(t, `{"verify": "tail"}`, "", 64*4096)
	p.moveInEveryMode(t, 64, 4096)
	all := int64(len(verify.Modes) * 64 * 4096)
	require.Equal(t, all, pushed(t, p.send))
	require.Equal(t, all, mapped(t, p.send), "every byte went by memcpy")
}

// Free shuts the sender out (its writes fail as unregistered, nothing
// lands in the freed memory's file), and the sender lets go of its
// mapping at its next try, so freed memory is freed on both sides.
func TestFreeShutsOutTheSenderAndReleasesItsMapping(t *testing.T) {
	before := samehost.SharedMapped()
	p := newMappedPair(t, "", "", 16*4096)
	s := keepSending(t, p, p.blocks(16, 4096))
	s.until(&s.ok, 20)
	require.Equal(t, before+1, samehost.SharedMapped(), "one mapping, shared by the session's connections")
	require.NoError(t, p.recv.Free(p.dst.addr(0)))
	_, still := samehost.LookupShared(p.dst.addr(0), 1, p.recv.regions)
	require.False(t, still, "the receiver let go of it")
	s.until(&s.failed, 20)
	s.stop()
	require.Equal(t, before, samehost.SharedMapped(), "the sender let go of it at its next try")
	require.Positive(t, mapped(t, p.send))
}

func TestAllocAndFreeRefuseBadInput(t *testing.T) {
	g := openGuard(t, "")
	_, err := g.Alloc(0)
	require.ErrorIs(t, err, errs.InvalidArg)
	_, err = g.Alloc(1 << 62)
	require.ErrorIs(t, err, errs.InvalidArg)
	m := allocated(t, g, 5000)
	require.Len(t, m.b, 5000)
	require.Equal(t, make([]byte, 5000), m.b, "zeroed")
	require.ErrorIs(t, g.Free(m.addr(1)), errs.InvalidArg, "not the start of an allocation")
	other := newMem(t, 4096)
	require.NoError(t, g.Register(other.addr(0), 4096))
	require.ErrorIs(t, g.Free(other.addr(0)), errs.InvalidArg, "registered, but not allocated here")
	require.NoError(t, g.Free(m.addr(0)))
	require.ErrorIs(t, g.Free(m.addr(0)), errs.InvalidArg, "freed twice")
	require.ErrorIs(t, g.regions.Check(m.addr(0), 4096), errs.NotRegistered, "freed memory is unregistered")
	_, ok := samehost.LookupShared(m.addr(0), 1, g.regions)
	require.False(t, ok, "and unmapped")
}

// Free unregisters what the caller registered of an allocation, not only
// the whole: no table entry is left naming freed memory.
func TestFreeUnregistersPartsRegisteredSince(t *testing.T) {
	g := openGuard(t, "")
	m := allocated(t, g, 3*4096)
	require.NoError(t, g.Unregister(m.addr(0)))
	require.NoError(t, g.Register(m.addr(4096), 4096))
	require.NoError(t, g.Free(m.addr(0)))
	require.ErrorIs(t, g.regions.Check(m.addr(4096), 4096), errs.NotRegistered)
	require.Empty(t, g.regions.Snapshot())
}

// Close frees what Alloc gave; a region the caller unregistered first is
// freed as well.
func TestCloseFreesAllocations(t *testing.T) {
	g, err := Open(testConfig(t, ""))
	require.NoError(t, err)
	a := allocated(t, g, 4096)
	b := allocated(t, g, 8192)
	require.NoError(t, g.Unregister(b.addr(0)))
	require.NoError(t, g.Close())
	for _, m := range []*mem{a, b} {
		_, ok := samehost.LookupShared(m.addr(0), 1, g.regions)
		require.False(t, ok)
	}
}

// A batch large enough to be copied by several threads lands whole.
func TestALargeBatchIntoAllocatedMemoryLandsWhole(t *testing.T) {
	const size = 3 << 20 // three 3 MiB blocks: cut across blocks into runs
	p := newMappedPair(t, `{"verify": "full"}`, "", 3*size)
	fill(p.src.b)
	_, err := p.send.Transfer(p.session, p.blocks(3, size), TransferOptions{})
	require.NoError(t, err)
	require.True(t, bytes.Equal(p.src.b, p.dst.b))
	require.EqualValues(t, 3*size, mapped(t, p.send))
}

// Only the guard that allocated memory offers it for mapping: another
// guard of the process that registers it too is written with
// process_vm_writev, so that the owner's Free cannot leave a sender
// writing into a mapping that outlived the memory at that address.
func TestAnotherGuardsAllocationIsNotMapped(t *testing.T) {
	owner := openGuard(t, "")
	p := &pair{src: newMem(t, 4096)}
	p.send, p.recv = openGuard(t, ""), openGuard(t, "")
	p.dst = allocated(t, owner, 4096)
	require.NoError(t, p.send.Register(p.src.addr(0), 4096))
	require.NoError(t, p.recv.Register(p.dst.addr(0), 4096))
	p.session = p.recv.Endpoint()
	fill(p.src.b)
	_, err := p.send.Transfer(p.session, p.blocks(1, 4096), TransferOptions{})
	require.NoError(t, err)
	require.Equal(t, p.src.b, p.dst.b)
	require.EqualValues(t, 4096, pushed(t, p.send))
	require.Zero(t, mapped(t, p.send))
}

// A receiver that allocates and frees over and over while a sender writes
// each allocation leaves no mapping behind on either side: each is let go
// of at the sender's next transfer after the free.
func TestAllocFreeCyclesLeaveNoMappings(t *testing.T) {
	before := samehost.SharedMapped()
	send, recv := openGuard(t, ""), openGuard(t, "")
	src := newMem(t, 8192)
	require.NoError(t, send.Register(src.addr(0), 8192))
	for i := 0; i < 60; i++ {
		dst := allocated(t, recv, 8192)
		fill(src.b)
		_, err := send.Transfer(recv.Endpoint(), []desc.Desc{{Src: src.addr(0), Dst: dst.addr(0), Len: 8192}}, TransferOptions{})
		require.NoError(t, err)
		require.Equal(t, src.b, dst.b)
		require.LessOrEqual(t, samehost.SharedMapped(), before+2, "cycle %d: at most the live allocation and the one freed last", i)
		require.NoError(t, recv.Free(dst.addr(0)))
	}
	require.EqualValues(t, 60*8192, mapped(t, send))
	other := allocated(t, recv, 4096) // a transfer after the last free lets go of its mapping
	_, err := send.Transfer(recv.Endpoint(), []desc.Desc{{Src: src.addr(0), Dst: other.addr(0), Len: 4096}}, TransferOptions{})
	require.NoError(t, err)
	require.Equal(t, before+1, samehost.SharedMapped())
}
