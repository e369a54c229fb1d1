package core

import (
	"crypto/rand"
	mrand "math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/core/desc"
	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/verify"
)

// Consecutive blocks go over the socket as one write per run (inside one
// registered region at each end, tcp/join_test.go), and stats count the
// descriptors joined: every mode delivers them, the same host's copies
// too (written by the sender itself there, one copy each, none joined).
func TestConsecutiveBlocksInEveryMode(t *testing.T) {
	for _, plane := range []string{`"same_host": "off"`, `"same_host": "required"`} {
		p := newPair(t, `{`+plane+`}`, "", 256<<10)
		for i, mode := range verify.Modes {
			rand.Read(p.src.b)
			descs := p.blocks(64, 4096)
			res, err := p.send.Transfer(p.session, descs, TransferOptions{Verify: &mode})
			require.NoError(t, err, "%s %s", plane, mode)
			if mode == verify.Digest {
				require.NoError(t, p.recv.SyncTransfers([]uint64{res.ID}, 0))
			}
			require.Equal(t, p.src.b, p.dst.b, "%s %s", plane, mode)
			if plane == `"same_host": "off"` {
				require.EqualValues(t, 63*(i+1), stats(t, p.send)["joined_descriptors"], "64 blocks, one write")
			}
		}
		// Backwards: nothing continues, nothing is joined.
		before := stats(t, p.send)["joined_descriptors"]
		descs := p.blocks(64, 4096)
		for i, j := 0, len(descs)-1; i < j; i, j = i+1, j-1 {
			descs[i].Dst, descs[j].Dst = descs[j].Dst, descs[i].Dst
		}
		_, err := p.send.Transfer(p.session, descs, TransferOptions{})
		require.NoError(t, err)
		require.Equal(t, before, stats(t, p.send)["joined_descriptors"])
	}
}

// A receiver that cut a region in two after the sender's handshake: the
// sender's table is older, and its write across the new boundary is
// refused. The sender shakes hands again, learns the two regions and
// writes the chunk once more, so the transfer succeeds; in digest mode,
// whose notice may already be out, it fails instead, naming the
// descriptors written as one, and the next transfer goes through.
func TestJoinedWritesAfterTheReceiverRegisteredAgain(t *testing.T) {
	for _, mode := range []verify.Mode{verify.Off, verify.Tail, verify.Sample, verify.Digest} {
		t.Run(string(mode), func(t *testing.T) {
			p := newPair(t, `{"same_host": "off"}`, "", 8192)
			descs := p.blocks(2, 4096)
			transfer := func() error {
				res, err := p.send.Transfer(p.session, descs, TransferOptions{Verify: &mode})
				if err == nil && mode == verify.Digest {
					err = p.recv.SyncTransfers([]uint64{res.ID}, 0)
				}
				return err
			}
			require.NoError(t, transfer())
			require.NoError(t, p.recv.Unregister(p.dst.addr(0)))
			require.NoError(t, p.recv.Register(p.dst.addr(0), 4096))
			require.NoError(t, p.recv.Register(p.dst.addr(4096), 4096))

			rand.Read(p.src.b)
			err := transfer()
			if mode == verify.Digest {
				require.ErrorIs(t, err, errs.NotRegistered)
				require.Contains(t, err.Error(), "descriptors 0 to 1 (written as one)")
				err = transfer()
			}
			require.NoError(t, err)
			require.Equal(t, p.src.b, p.dst.b)
		})
	}
}

// Random batches over the socket, on the same host and over RDMA: descriptors of
// mixed sizes, mostly consecutive, some after a gap, both ends cut into
// three registered regions at random places (each descriptor inside one
// region at each end). Every transfer succeeds and every descriptor's
// destination equals its source; writes were joined along the way.
func TestJoinedTransfersOnRandomBatches(t *testing.T) {
	const size = 2 << 20
	r := mrand.New(mrand.NewPCG(3, 5))
	// On the same host the receiver copies the bytes out of the sender
	// (same_host_writer "receiver"): pulled writes, joined as the socket's.
	// Over RDMA (the NIC model, four queue pairs) WRITEs join the same way.
	rdma := rdmaKey(t)
	for _, plane := range [][2]string{{`"same_host": "off"`, ``}, {`"same_host": "required"`, `"same_host_writer": "receiver"`},
		{rdma + `, "rdma_qps": 4`, rdma}} {
		p := newPair(t, `{"verify": "tail", `+plane[0]+`}`, `{`+plane[1]+`}`, size)
		cuts := func(g *Guard, m *mem) []int {
			require.NoError(t, g.Unregister(m.addr(0)))
			a := 4096 * (1 + r.IntN(size/4096/2-1))
			b := a + 4096*(1+r.IntN((size-a)/4096-1))
			for _, rg := range [][2]int{{0, a}, {a, b}, {b, size}} {
				require.NoError(t, g.Register(m.addr(rg[0]), uint64(rg[1]-rg[0])))
			}
			return []int{a, b}
		}
		srcCuts, dstCuts := cuts(p.send, p.src), cuts(p.recv, p.dst)
		// next moves off to the cut if [off, off+n) would cross one.
		next := func(off, n int, at []int) int {
			for _, c := range at {
				if off < c && off+n > c {
					return c
				}
			}
			return off
		}
		lens := []int{64, 1000, 4096, 4096, 4096, 65536}
		for round := 0; round < 30; round++ {
			rand.Read(p.src.b)
			var descs []desc.Desc
			s, d := 0, 0
			for k := 1 + r.IntN(64); k > 0; k-- {
				n := lens[r.IntN(len(lens))]
				if r.IntN(4) == 0 {
					s += 64 * r.IntN(3)
					d += 64 * r.IntN(3)
				}
				s, d = next(s, n, srcCuts), next(d, n, dstCuts)
				if s+n > size || d+n > size {
					break
				}
				descs = append(descs, desc.Desc{Src: p.src.addr(s), Dst: p.dst.addr(d), Len: uint64(n)})
				s, d = s+n, d+n
			}
			_, err := p.send.Transfer(p.session, descs, TransferOptions{})
			require.NoError(t, err, "%s round %d", plane, round)
			for i, x := range descs {
				so, do := int(x.Src-p.src.addr(0)), int(x.Dst-p.dst.addr(0))
				require.Equal(t, p.src.b[so:so+int(x.Len)], p.dst.b[do:do+int(x.Len)], "%s round %d descriptor %d", plane, round, i)
			}
		}
		require.Positive(t, stats(t, p.send)["joined_descriptors"], plane)
	}
}
