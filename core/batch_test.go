package core

import (
	"bytes"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/verify"
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
			descs, want := make([]verify.Desc, n), make([]byte, n*size)
			for i := range descs {
				from := p.src
				if (i/(1+i%3))%2 == 1 {
					from = other
				}
				descs[i] = verify.Desc{Src: from.addr(i * size), Dst: p.dst.addr(i * size), Len: size}
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
	const n, size = 64, 4096 // 256 KiB: batched, and fewer frames than are left owed (no reply goroutine)
	for _, mode := range []string{"off", "tail", "sample", "digest"} {
		t.Run(mode, func(t *testing.T) {
			p := newPair(t, `{"verify": "`+mode+`", "same_host": "off"}`, "", n*size)
			descs := p.blocks(n, size)
			ids := make([]uint64, 1)
			transfer := func() {
				res, err := p.send.Transfer(p.session, descs, TransferOptions{})
				if err != nil {
					t.Fatal(err)
				}
				if mode == "digest" {
					ids[0] = res.ID
					if err := p.recv.SyncTransfers(ids, 0); err != nil {
						t.Fatal(err)
					}
				}
			}
			for i := 0; i < 50; i++ {
				transfer()
			}
			require.LessOrEqual(t, testing.AllocsPerRun(200, transfer), 1.0, "allocations per transfer")
		})
	}
}
