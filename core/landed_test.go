package core

import (
	"bytes"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/core/desc"
	"github.com/mcguard/mcguard/core/errs"
)

const landing = `{"digest_at": "landing"}`

func landedAndRead(t *testing.T, g *Guard) (landed, read int64) {
	s := stats(t, g)
	return int64(s["digests_landed"].(float64)), int64(s["digests_read"].(float64))
}

// Digest mode's receiver compares the digests its target took as the bytes
// landed, over the socket and on the same host, descriptors of one slice
// and of several; digest_at "sync" reads the memory instead.
func TestDigestsTakenAsTheBytesLand(t *testing.T) {
	for _, c := range []struct {
		name, send, recv string
		n, size          int
		landed           bool
	}{
		{"socket", `{"verify": "digest", "same_host": "off"}`, landing, 64, 4096, true},
		{"same host", `{"verify": "digest"}`, landing, 64, 4096, true},
		{"sliced descriptors", `{"verify": "digest", "same_host": "off"}`, landing, 2, 9<<20 + 123, true},
		// three chunks of max_batch, a notice and a landed set each, found
		// in order; more 4 KiB descriptors than fit one index bucket
		{"chunks", `{"verify": "digest", "same_host": "off"}`, landing, 1500, 4096, true},
		{"digest_at sync (the default)", `{"verify": "digest"}`, ``, 64, 4096, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			p := newPair(t, c.send, c.recv, c.n*c.size)
			for round := 1; round <= 3; round++ {
				fill(p.src.b)
				res, err := p.send.Transfer(p.session, p.blocks(c.n, c.size), TransferOptions{})
				require.NoError(t, err)
				require.NoError(t, p.recv.SyncTransfers([]uint64{res.ID}, 0))
				require.True(t, bytes.Equal(p.src.b, p.dst.b))
				landed, read := landedAndRead(t, p.recv)
				if c.landed {
					require.EqualValues(t, round*c.n, landed, "every range compared as it landed")
					require.Zero(t, read)
				} else {
					require.Zero(t, landed)
					require.EqualValues(t, round*c.n, read, "every range read again at sync")
				}
			}
		})
	}
}

// A later write over a landed range makes its sync read the memory again:
// the landed digest no longer describes it.
func TestALaterWriteInvalidatesALandedDigest(t *testing.T) {
	p := newPair(t, `{"verify": "digest", "same_host": "off"}`, landing, 64*4096)
	fill(p.src.b)
	first, err := p.send.Transfer(p.session, p.blocks(64, 4096), TransferOptions{})
	require.NoError(t, err)
	// Other bytes over descriptor 7 (and half of 8), before the first is synced.
	fill(p.src.b[7*4096 : 8*4096+2048])
	over := []desc.Desc{{Src: p.src.addr(7 * 4096), Dst: p.dst.addr(7 * 4096), Len: 4096 + 2048}}
	second, err := p.send.Transfer(p.session, over, TransferOptions{})
	require.NoError(t, err)
	err = p.recv.SyncTransfers([]uint64{first.ID}, 0)
	require.ErrorIs(t, err, errs.Verify, "the memory no longer holds the first transfer's bytes at 7 and 8")
	require.ErrorContains(t, err, "descriptor 7")
	landed, read := landedAndRead(t, p.recv)
	require.EqualValues(t, 62, landed)
	require.EqualValues(t, 2, read, "the two overwritten ranges were read again")
	require.NoError(t, p.recv.SyncTransfers([]uint64{second.ID}, 0))
}

// What the two settings prove differs: a change by the application after
// the bytes landed is seen only by digest_at "sync".
func TestDigestAtSyncSeesWhatLandingCannot(t *testing.T) {
	for _, at := range []string{"landing", "sync"} {
		t.Run(at, func(t *testing.T) {
			p := newPair(t, `{"verify": "digest", "same_host": "off"}`, `{"digest_at": "`+at+`"}`, 4*4096)
			fill(p.src.b)
			res, err := p.send.Transfer(p.session, p.blocks(4, 4096), TransferOptions{})
			require.NoError(t, err)
			p.dst.b[100] ^= 0xff // the application scribbles on a block before syncing it
			err = p.recv.SyncTransfers([]uint64{res.ID}, 0)
			if at == "sync" {
				require.ErrorIs(t, err, errs.Verify)
			} else {
				require.NoError(t, err, "landing proves what landed, not what memory holds later")
			}
		})
	}
}

// Unregistering a region forgets the landed digests: its memory may be
// reused before a sync.
func TestUnregisterForgetsLandedDigests(t *testing.T) {
	p := newPair(t, `{"verify": "digest", "same_host": "off"}`, landing, 4*4096)
	fill(p.src.b)
	res, err := p.send.Transfer(p.session, p.blocks(4, 4096), TransferOptions{})
	require.NoError(t, err)
	require.NoError(t, p.recv.Unregister(p.dst.addr(0)))
	require.NoError(t, p.recv.Register(p.dst.addr(0), uint64(len(p.dst.b))))
	require.NoError(t, p.recv.SyncTransfers([]uint64{res.ID}, 0))
	landed, read := landedAndRead(t, p.recv)
	require.Zero(t, landed)
	require.EqualValues(t, 4, read)
}

// Taking digests as the bytes land costs next to no allocation per
// descriptor: entries come from slabs, emptied bucket lists are reused,
// and a connection's list of what landed is sized from its last notice.
// (One allocation per entry and per bucket list made 687 per transfer
// and sync of 512 descriptors.)
func TestLandingAllocatesLittlePerDescriptor(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector allocates for its own bookkeeping; make test also runs this without it")
	}
	const n, size = 512, 4096
	p := newPair(t, `{"verify": "digest", "same_host": "off"}`, landing, n*size)
	transfer := p.transferer(t, p.blocks(n, size), true)
	for range 20 {
		transfer()
	}
	before, _ := landedAndRead(t, p.recv)
	require.LessOrEqual(t, testing.AllocsPerRun(50, transfer), float64(n/8), "allocations per transfer and sync")
	after, read := landedAndRead(t, p.recv)
	require.EqualValues(t, 51*n, after-before, "every descriptor compared as it landed")
	require.Zero(t, read)
}
