package core

import (
	"bytes"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/core/desc"
	"github.com/mcguard/mcguard/verify"
)

// A session over four TCP connections: large batches are striped over
// them (a single large descriptor cut between them), small ones go on the
// first; every mode delivers, checked here byte for byte and by the
// receiver's sync in digest mode. The other connections open at the first
// large batch, and only over the socket: on one host the sender writes
// into the receiver itself, over one connection.
func TestStripedSessions(t *testing.T) {
	for _, plane := range []string{`"same_host": "off"`, `"same_host": "auto"`} {
		p := newPair(t, `{"tcp_stripes": 4, `+plane+`}`, ``, 64*(256<<10))
		for _, mode := range verify.Modes {
			for _, shape := range [][2]int{{3, 4096}, {64, 256 << 10}, {1, 16 << 20}, {3, 4<<20 + 4096}} {
				clear(p.dst.b)
				fill(p.src.b)
				res, err := p.send.Transfer(p.session, p.blocks(shape[0], shape[1]), TransferOptions{Verify: ptr(mode)})
				require.NoError(t, err, "%s %s %v", plane, mode, shape)
				if mode == verify.Digest {
					require.NoError(t, p.recv.SyncTransfers([]uint64{res.ID}, 0))
				}
				n := shape[0] * shape[1]
				require.True(t, bytes.Equal(p.src.b[:n], p.dst.b[:n]), "%s %s %v", plane, mode, shape)
				if mode == verify.Modes[0] && shape[0] == 3 && shape[1] == 4096 {
					require.Equal(t, 1, p.recv.planes[0].Connections(), "%s: before a large batch, one connection", plane)
				}
			}
		}
		require.EqualValues(t, 4, stats(t, p.send)["tcp_stripes"])
		want := 4 // one data connection per stripe
		if plane == `"same_host": "auto"` {
			want = 1
		}
		require.Equal(t, want, p.recv.planes[0].Connections(), plane)
	}
}

// Descriptors of very different sizes are striped whole, in order.
func TestStripedUnevenDescriptors(t *testing.T) {
	p := newPair(t, `{"tcp_stripes": 3, "same_host": "off"}`, ``, 10<<20)
	fill(p.src.b)
	// Uneven descriptors: the runs still cover the batch, in order.
	descs := []desc.Desc{}
	off := 0
	for _, n := range []int{5 << 20, 1 << 20, 4096, 2 << 20, 123, 1<<20 + 77} {
		descs = append(descs, desc.Desc{Src: p.src.addr(off), Dst: p.dst.addr(off), Len: uint64(n)})
		off += n
	}
	_, err := p.send.Transfer(p.session, descs, TransferOptions{})
	require.NoError(t, err)
	require.True(t, bytes.Equal(p.src.b[:off], p.dst.b[:off]))
}

// Striping keeps what tail checks: a cut inside a descriptor falls where
// one connection cuts its frames anyway, so no frame ends where tail does
// not look. With cuts anywhere (4 KiB aligned, as first written), a torn
// frame ending at a cut passed tail: 70 of 610 successes held wrong bytes
// under stress with 3 stripes and 5 % tears.
func TestStripedTailCatchesTornWrites(t *testing.T) {
	const n, size = 8, 512 << 10 // 7 shares of about 599 KiB: every cut would fall inside a descriptor
	p := newPair(t, `{"verify": "tail", "tcp_stripes": 7, "same_host": "off", "max_retries": 3, "retry_sleep_s": 0.001}`,
		`{"inject": "tear", "inject_rate": 0.05, "inject_seed": 5}`, n*size)
	ok, wrong := 0, 0
	for round := 0; round < 100; round++ {
		fill(p.src.b)
		if _, err := p.send.Transfer(p.session, p.blocks(n, size), TransferOptions{}); err != nil {
			continue
		}
		ok++
		if !bytes.Equal(p.src.b, p.dst.b) {
			wrong++
		}
	}
	t.Logf("%d of 100 succeeded", ok)
	require.Positive(t, ok)
	require.Zero(t, wrong, "successes with wrong bytes at the receiver")
}
