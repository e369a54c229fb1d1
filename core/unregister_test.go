package core

import (
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/core/desc"
)

// Unregister waits for a transfer that reads the region: once it returns
// the application may unmap the memory, and a full read-back still
// comparing against the source killed the process ("unexpected fault
// address") when it did.
func TestUnregisterWaitsForTheTransfersReadingTheSource(t *testing.T) {
	const size = 16 << 20
	dst := newMem(t, size)
	send := openGuard(t, `{"verify": "full"}`)
	recv := openGuard(t, "")
	require.NoError(t, recv.Register(dst.addr(0), size))
	// How long one transfer takes, so that the rounds unregister at points
	// spread over it.
	warm := newMem(t, size)
	require.NoError(t, send.Register(warm.addr(0), size))
	start := time.Now()
	_, err := send.Transfer(recv.Endpoint(), []desc.Desc{{Src: warm.addr(0), Dst: dst.addr(0), Len: size}}, TransferOptions{})
	require.NoError(t, err)
	took := time.Since(start)
	const rounds = 64
	var ok, failed int
	for round := range rounds {
		src, err := syscall.Mmap(-1, 0, size, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
		require.NoError(t, err)
		fill(src)
		m := &mem{b: src}
		require.NoError(t, send.Register(m.addr(0), size))
		stop := make(chan struct{})
		done := make(chan struct{})
		go func() {
			defer close(done)
			for {
				select {
				case <-stop:
					return
				default:
				}
				if _, err := send.Transfer(recv.Endpoint(), []desc.Desc{{Src: m.addr(0), Dst: dst.addr(0), Len: size}}, TransferOptions{}); err != nil {
					failed++
					return
				}
				ok++
			}
		}()
		time.Sleep(took * time.Duration(round) / rounds)
		require.NoError(t, send.Unregister(m.addr(0)))
		require.NoError(t, syscall.Munmap(src)) // a transfer still reading it would fault here
		close(stop)
		<-done
	}
	t.Logf("one transfer took %v; %d transfers succeeded, %d failed as their source went", took, ok, failed)
	require.Positive(t, failed, "transfers that began after Unregister were refused")
}
