package core

import (
	"crypto/rand"
	"fmt"
	mrand "math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/core/desc"
	"github.com/mcguard/mcguard/core/errs"
)

// In every read-back mode a batch of several chunks posts each chunk's
// writes while the chunk before it is checked, over the socket; on random
// batches (mixed sizes, gaps, blocks out of order) every descriptor lands.
func TestChunksPipelinedInEveryReadBackMode(t *testing.T) {
	const size = 4 << 20
	r := mrand.New(mrand.NewPCG(7, 11))
	for _, mode := range []string{"tail", "sample", "full"} {
		t.Run(mode, func(t *testing.T) {
			p := newPair(t, fmt.Sprintf(`{"verify": %q, "same_host": "off", "max_batch": 16}`, mode), "", size)
			lens := []int{64, 1000, 4096, 4096, 65536}
			chunks := 0
			for round := 0; round < 20; round++ {
				rand.Read(p.src.b)
				descs := randomBlocks(r, p, size, lens, 1+r.IntN(100))
				_, err := p.send.Transfer(p.session, descs, TransferOptions{})
				require.NoError(t, err, "round %d", round)
				requireLanded(t, p, descs, fmt.Sprint("round ", round))
				chunks += (len(descs)+15)/16 - 1
			}
			require.EqualValues(t, chunks, stats(t, p.send)["pipelined_chunks"], "every chunk after the first")
		})
	}
}

// post_ahead false: each chunk's writes wait for the check of the one
// before it, as they did before chunks were posted ahead.
func TestPostAheadOff(t *testing.T) {
	const n, size = 64, 4096
	p := newPair(t, `{"verify": "tail", "same_host": "off", "max_batch": 16, "post_ahead": false}`, "", n*size)
	fill(p.src.b)
	_, err := p.send.Transfer(p.session, p.blocks(n, size), TransferOptions{})
	require.NoError(t, err)
	require.Equal(t, p.src.b, p.dst.b)
	st := stats(t, p.send)
	require.Zero(t, st["pipelined_chunks"])
	require.Equal(t, false, st["post_ahead"])
	require.Equal(t, true, stats(t, p.recv)["post_ahead"], "the default")
}

// Two chunks that write the same destinations: the later one's bytes
// stay, as without pipelining, also when writes are lost and re-sent
// (the earlier chunk's re-send lands after the later chunk's writes; the
// later chunk's own check then sees that and writes its bytes again).
// Failing instead of re-sending, a transfer fails only where bytes were
// really lost.
func TestPipelinedChunksWritingTheSamePlace(t *testing.T) {
	const n, size = 64, 4096
	for _, inject := range []string{`"inject": "none"`, `"inject": "drop", "inject_rate": 0.2, "inject_seed": 3`} {
		t.Run(inject, func(t *testing.T) {
			p := newPair(t, `{"verify": "tail", "same_host": "off", "max_batch": 16, "on_mismatch": "resend", "max_resends": 20}`,
				`{`+inject+`}`, 2*n*size)
			// Chunks 2j and 2j+1 (16 blocks each) write the same 16
			// destination blocks, from source blocks of their own.
			descs := make([]desc.Desc, 2*n)
			for i := range descs {
				c, k := i/16, i%16
				descs[i] = desc.Desc{Src: p.src.addr(i * size), Dst: p.dst.addr((c/2*16 + k) * size), Len: size}
			}
			for round := 0; round < 10; round++ {
				rand.Read(p.src.b)
				_, err := p.send.Transfer(p.session, descs, TransferOptions{})
				require.NoError(t, err, "round %d", round)
				for j := 0; j < n/16; j++ {
					later := (2*j + 1) * 16 * size
					require.Equal(t, p.src.b[later:later+16*size], p.dst.b[j*16*size:(j+1)*16*size], "round %d: the later chunk's bytes in blocks %d-%d", round, 16*j, 16*j+15)
				}
			}
			st := stats(t, p.send)
			require.EqualValues(t, 10*7, st["pipelined_chunks"])
			if inject != `"inject": "none"` {
				require.Positive(t, st["resends"])
			}
		})
	}
}

// randomBlocks is a batch of up to k blocks of the given lengths, in
// order with gaps, or backwards, inside p's memory of size bytes.
func randomBlocks(r *mrand.Rand, p *pair, size int, lens []int, k int) []desc.Desc {
	var descs []desc.Desc
	s, d := 0, 0
	for ; k > 0; k-- {
		n := lens[r.IntN(len(lens))]
		if r.IntN(4) == 0 {
			s += 64 * r.IntN(3)
			d += 64 * r.IntN(3)
		}
		if s+n > size || d+n > size {
			break
		}
		descs = append(descs, desc.Desc{Src: p.src.addr(s), Dst: p.dst.addr(d), Len: uint64(n)})
		s, d = s+n, d+n
	}
	if r.IntN(3) == 0 { // backwards at the destination: nothing joins
		for i, j := 0, len(descs)-1; i < j; i, j = i+1, j-1 {
			descs[i].Dst, descs[j].Dst = descs[j].Dst, descs[i].Dst
			descs[i].Len = min(descs[i].Len, descs[j].Len)
			descs[j].Len = descs[i].Len
		}
	}
	return descs
}

// requireLanded compares every descriptor's destination with its source.
func requireLanded(t *testing.T, p *pair, descs []desc.Desc, what string) {
	t.Helper()
	for i, x := range descs {
		so, do := int(x.Src-p.src.addr(0)), int(x.Dst-p.dst.addr(0))
		require.Equal(t, p.src.b[so:so+int(x.Len)], p.dst.b[do:do+int(x.Len)], "%s descriptor %d", what, i)
	}
}

// A transfer's deadline ends it while a chunk posted ahead is still on
// its way to a target that stopped reading (its fence waits for writes a
// lag holds for up to 3 s; every write lags, so the first chunk's check
// is still waiting, its read request sent and the second chunk handed to
// the connection's poster, when the deadline comes): the call returns at
// the deadline, and the session's next transfer goes through on a new
// connection.
func TestDeadlineEndsAPipelinedTransfer(t *testing.T) {
	const n, size = 256, 64 << 10 // chunks of 16 x 64 KiB: more than the socket buffers hold
	p := newPair(t, `{"verify": "tail", "same_host": "off", "max_batch": 16}`,
		`{"inject": "lag", "inject_rate": 1, "inject_lag_max_ms": 3000, "inject_seed": 1}`, n*size)
	fill(p.src.b)
	start := time.Now()
	_, err := p.send.Transfer(p.session, p.blocks(n, size), TransferOptions{Deadline: 300 * time.Millisecond})
	require.ErrorIs(t, err, errs.Timeout)
	require.Less(t, time.Since(start), 2*time.Second, "the deadline ended the call, not the lag")

	// Four blocks, one write (lagged like every write), on a new connection.
	fill(p.src.b[:4*size])
	_, err = p.send.Transfer(p.session, p.blocks(4, size), TransferOptions{})
	require.NoError(t, err)
	require.Equal(t, p.src.b[:4*size], p.dst.b[:4*size])
}
