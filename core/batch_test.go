package core

import (
	"bytes"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/core/desc"
	"github.com/mcguard/mcguard/core/errs"
)

// unregisterPromptly fails t unless g unregisters addr within two
// seconds: a source still held by a batch that was never sent would keep
// Unregister waiting.
func unregisterPromptly(t *testing.T, g *Guard, addr uint64) {
	done := make(chan error, 1)
	go func() { done <- g.Unregister(addr) }()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(2 * time.Second):
		t.Fatalf("unregistering %#x still waits: a write batch holds it", addr)
	}
}

// A large batch's writes go out by writev from the sources themselves,
// holding each source region only while its frames are queued.
func TestBatchedWritesAcrossSourceRegions(t *testing.T) {
	const n, size = 256, 4096
	for _, mode := range []string{"off", "tail", "sample", "digest"} {
		t.Run(mode, func(t *testing.T) {
			p := newPair(t, `{"verify": "`+mode+`", "same_host": "off"}`, "", n*size)
			other := newMem(t, n*size)
			require.NoError(t, p.send.Register(other.addr(0), uint64(n*size)))
			fill(p.src.b)
			fill(other.b)
			// Sources alternate between the two regions, runs of 1 to 3.
			descs, want := make([]desc.Desc, n), make([]byte, n*size)
			for i := range descs {
				from := p.src
				if (i/(1+i%3))%2 == 1 {
					from = other
				}
				descs[i] = desc.Desc{Src: from.addr(i * size), Dst: p.dst.addr(i * size), Len: size}
				copy(want[i*size:], from.b[i*size:(i+1)*size])
			}
			res, err := p.send.Transfer(p.session, descs, TransferOptions{})
			require.NoError(t, err)
			if mode == "digest" {
				require.NoError(t, p.recv.SyncTransfers([]uint64{res.ID}, 0))
			}
			require.True(t, bytes.Equal(want, p.dst.b), "every descriptor from its own region")
			unregisterPromptly(t, p.send, other.addr(0))
			unregisterPromptly(t, p.send, p.src.addr(0))
		})
	}
}

// A batch cut off mid-send (the receiver closed) lets go of its source.
func TestBatchCutOffReleasesItsSource(t *testing.T) {
	const n, size = 8192, 4096
	p := newPair(t, `{"verify": "tail", "same_host": "off", "timeout_ms": 2000}`, "", n*size)
	_, err := p.send.Transfer(p.session, p.blocks(16, size), TransferOptions{}) // connected
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() {
		var err error
		for k := 0; k < 50 && err == nil; k++ {
			_, err = p.send.Transfer(p.session, p.blocks(n, size), TransferOptions{})
		}
		done <- err
	}()
	time.Sleep(20 * time.Millisecond)
	require.NoError(t, p.recv.Close())
	select {
	case err := <-done:
		require.Error(t, err, "the receiver closed while batches went out")
	case <-time.After(10 * time.Second):
		t.Fatal("the transfer did not end after its receiver closed")
	}
	unregisterPromptly(t, p.send, p.src.addr(0))
}

// A batched transfer (writev from the sources) allocates nothing in
// steady state either, in every mode, the receiver's sync included.
func TestBatchedTransferAllocatesNothing(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector allocates for its own bookkeeping; make test also runs this without it")
	}
	// 64 frames: fewer than are left owed. 2048 in one chunk: more, so
	// the older acknowledgements are read while later frames go out, and
	// digest's notice is larger than a connection keeps a buffer for.
	// 2048 in chunks of 512: each chunk's sources digested beside its
	// writes.
	for _, shape := range []struct{ n, maxBatch, runs int }{{64, 512, 200}, {2048, 4096, 30}, {2048, 512, 30}} {
		for _, mode := range []string{"off", "tail", "sample", "digest"} {
			t.Run(fmt.Sprintf("%dx4KiB/max_batch=%d/%s", shape.n, shape.maxBatch, mode), func(t *testing.T) {
				const size = 4096
				n := shape.n
				p := newPair(t, fmt.Sprintf(`{"verify": %q, "same_host": "off", "max_batch": %d}`, mode, shape.maxBatch), "", n*size)
				transfer := p.transferer(t, p.blocks(n, size), mode == "digest")
				for i := 0; i < 20; i++ {
					transfer()
				}
				require.Zero(t, testing.AllocsPerRun(shape.runs, transfer), "allocations per transfer")
			})
		}
	}
}

// A chunk of more frames than are left owed (maxOwed) reads the older
// answers while its later frames go out: by writev (3 MiB) and through
// the buffered writer (48 KiB), in every mode.
func TestLongChunkReadsAnswersAsItGoes(t *testing.T) {
	for _, size := range []int{1024, 16} {
		for _, mode := range []string{"off", "tail", "sample", "digest"} {
			t.Run(fmt.Sprintf("3000x%dB/%s", size, mode), func(t *testing.T) {
				const n = 3000
				p := newPair(t, `{"verify": "`+mode+`", "same_host": "off", "max_batch": 4096}`, "", n*size)
				for range 3 {
					fill(p.src.b)
					res, err := p.send.Transfer(p.session, p.blocks(n, size), TransferOptions{})
					require.NoError(t, err)
					if mode == "digest" {
						require.NoError(t, p.recv.SyncTransfers([]uint64{res.ID}, 0))
					}
					require.True(t, bytes.Equal(p.src.b, p.dst.b), "destination equals source")
				}
			})
		}
	}
}

// A refusal in the middle of a long chunk fails the transfer, naming the
// descriptor, and leaves the connection in step for the next one.
func TestLongChunkRefusedMidway(t *testing.T) {
	const n, size = 3000, 1024
	for _, mode := range []string{"off", "tail"} {
		t.Run(mode, func(t *testing.T) {
			p := newPair(t, `{"verify": "`+mode+`", "same_host": "off", "max_batch": 4096}`, "", n*size)
			descs := p.blocks(n, size)
			descs[2000].Dst = p.dst.addr(0) + n*size // past the receiver's region
			_, err := p.send.Transfer(p.session, descs, TransferOptions{})
			require.ErrorIs(t, err, errs.NotRegistered)
			require.Contains(t, err.Error(), "descriptor 2000 ")
			fill(p.src.b)
			_, err = p.send.Transfer(p.session, p.blocks(n, size), TransferOptions{})
			require.NoError(t, err, "the connection is in step after the refusal")
			require.True(t, bytes.Equal(p.src.b, p.dst.b), "destination equals source")
		})
	}
}
