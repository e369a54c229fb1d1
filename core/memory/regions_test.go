package memory

import (
	"testing"

	"github.com/mcguard/mcguard/core/internal/testmem"
	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/core/errs"
)

// LoadRanges gives fn each range's bytes in order, across regions, and
// stops at a range outside them; no region stays held. CheckRanges finds
// the first range outside them.
func TestLoadRanges(t *testing.T) {
	base := AddrOf(testmem.Pages(t, 3))
	r := New(nil)
	require.NoError(t, r.Add(base, 4096))
	require.NoError(t, r.Add(base+4096, 4096)) // the third page is not registered
	var got []byte
	collect := func(b []byte) error { got = append(got, b[0], byte(len(b))); return nil }
	addrs := []uint64{base, base + 100, base + 4096, base + 4096 + 8, base + 200}
	lens := []uint64{10, 20, 30, 40, 50}
	require.NoError(t, r.LoadRanges(addrs, lens, nil, collect))
	require.Equal(t, []byte{0, 10, 0, 20, 1, 30, 1, 40, 0, 50}, got, "in order, across regions and back")

	got = nil
	err := r.LoadRanges([]uint64{base, base + 2*4096}, []uint64{8, 8}, nil, collect)
	require.ErrorIs(t, err, errs.NotRegistered)
	require.Equal(t, []byte{0, 8}, got, "the ranges before the bad one were given")
	require.Equal(t, -1, r.CheckRanges(addrs, lens))
	require.Equal(t, 2, r.CheckRanges([]uint64{base, base + 4096, base + 2*4096}, []uint64{8, 8, 8}), "the third page")
	require.Equal(t, 0, r.CheckRanges([]uint64{base + 4000}, []uint64{200}), "across two regions is not inside one")
	require.NoError(t, r.Remove(base), "nothing held: unregistering does not wait")
	require.NoError(t, r.Remove(base+4096))
}
