package core

import (
	"bytes"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/core/desc"
	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/core/internal/models"
	"github.com/mcguard/mcguard/verify"
)

// rdmaKey returns the config keys that put a guard's data plane on the
// software NIC.
func rdmaKey(t *testing.T) string {
	return fmt.Sprintf(`"transport": "rdma", "verbs_library": %q`, models.NICFor(t))
}

func TestRDMATransportOnTheModelInEveryMode(t *testing.T) {
	key := rdmaKey(t)
	p := newPair(t, "{"+key+"}", "{"+key+"}", 600*4096)
	require.Equal(t, "rdma", stats(t, p.send)["transport"])
	for _, mode := range verify.Modes {
		t.Run(string(mode), func(t *testing.T) {
			fill(p.src.b)
			descs := p.blocks(600, 4096) // two chunks, several queue depths
			res, err := p.send.Transfer(p.recv.Endpoint(), descs, TransferOptions{Verify: &mode})
			require.NoError(t, err)
			if mode == verify.Digest {
				require.NoError(t, p.recv.SyncTransfers([]uint64{res.ID}, 0))
			}
			if mode != verify.Off {
				require.True(t, bytes.Equal(p.src.b, p.dst.b))
			}
		})
	}
}

func TestRDMALagIsCaughtByTheFencedReadBack(t *testing.T) {
	key := rdmaKey(t)
	t.Setenv("MCG_NIC_LAG_US", "500000") // long enough to look before it lands, under the race detector too: the batch is one joined WRITE
	const n, size = 32, 4096
	p := newPair(t, "{"+key+`, "verify": "off"}`, "{"+key+"}", n*size)
	fill(p.src.b)
	_, err := p.send.Transfer(p.recv.Endpoint(), p.blocks(n, size), TransferOptions{})
	require.NoError(t, err, "off trusts the WRITE completions")
	require.False(t, bytes.Equal(p.src.b, p.dst.b), "a completed WRITE is not yet a visible one")
	fill(p.src.b)
	res, err := p.send.Transfer(p.recv.Endpoint(), p.blocks(n, size), TransferOptions{Verify: ptr(verify.Tail)})
	require.NoError(t, err)
	require.True(t, bytes.Equal(p.src.b, p.dst.b), "the READ on the same QP flushed every earlier write")
	require.Zero(t, res.Retries)
}

func TestRDMAErrorCompletionFailsTheTransferThenReconnects(t *testing.T) {
	key := rdmaKey(t)
	t.Setenv("MCG_NIC_FAIL_WR", "1") // the model fails the first WRITE after the guards open
	p := newPair(t, "{"+key+"}", "{"+key+"}", 8192)
	fill(p.src.b)
	_, err := p.send.Transfer(p.recv.Endpoint(), p.blocks(2, 4096), TransferOptions{})
	require.ErrorIs(t, err, errs.Peer, "an error completion is a failed transfer, never a success")
	require.Contains(t, err.Error(), "remote access error")
	_, err = p.send.Transfer(p.recv.Endpoint(), p.blocks(2, 4096), TransferOptions{})
	require.NoError(t, err, "the next transfer gets a new queue pair")
	require.True(t, bytes.Equal(p.src.b, p.dst.b))
}

func TestRDMAAndTCPGuardsTogether(t *testing.T) {
	key := rdmaKey(t)
	p := newPair(t, "", "{"+key+"}", 4096)
	fill(p.src.b)
	_, err := p.send.Transfer(p.recv.Endpoint(), p.blocks(1, 4096), TransferOptions{})
	require.NoError(t, err, "an RDMA guard still serves TCP peers through its TCP target")
	require.True(t, bytes.Equal(p.src.b, p.dst.b))
	q := newPair(t, "{"+key+"}", "", 4096)
	_, err = q.send.Transfer(q.recv.Endpoint(), q.blocks(1, 64), TransferOptions{})
	require.ErrorIs(t, err, errs.Session)
	require.Contains(t, err.Error(), `this guard does not serve transport "rdma" (it serves tcp)`)
	_, err = Open(testConfig(t, `{"transport": "rdma", "verbs_library": "/nonexistent/libibverbs.so.1"}`))
	require.ErrorIs(t, err, errs.Config)
}

// The fence alone (digest mode: no read-backs) makes lagging writes
// visible before the transfer returns: a FLUSH where both ends do the
// verb, a READ where either lacks it.
func TestRDMAFenceIsAFlushWhereBothEndsHaveIt(t *testing.T) {
	key := rdmaKey(t)
	t.Setenv("MCG_NIC_LAG_US", "50000")
	const n, size = 32, 4096
	for _, c := range []struct {
		name             string
		sendNo, recvNo   string // MCG_NIC_NO_FLUSH when each guard opens
		sendSays, recvSa string
	}{
		{"both", "0", "0", "fence FLUSH verb", "fence FLUSH verb"},
		{"neither", "1", "1", "fence READ", "fence READ"},
		{"target lacks it", "0", "1", "fence FLUSH verb", "fence READ"},
	} {
		t.Run(c.name, func(t *testing.T) {
			src, dst := newMem(t, n*size), newMem(t, n*size)
			t.Setenv("MCG_NIC_NO_FLUSH", c.recvNo) // the model reads it when a guard opens its device
			recv := openGuard(t, "{"+key+"}")
			t.Setenv("MCG_NIC_NO_FLUSH", c.sendNo)
			send := openGuard(t, "{"+key+`, "verify": "digest"}`)
			require.Contains(t, stats(t, send)["rdma"], c.sendSays)
			require.Contains(t, stats(t, recv)["rdma"], c.recvSa)
			require.NoError(t, send.Register(src.addr(0), n*size))
			require.NoError(t, recv.Register(dst.addr(0), n*size))
			p := &pair{src: src, dst: dst, send: send, recv: recv}
			for round := 0; round < 3; round++ {
				fill(src.b)
				res, err := send.Transfer(recv.Endpoint(), p.blocks(n, size), TransferOptions{})
				require.NoError(t, err)
				require.True(t, bytes.Equal(src.b, dst.b), "round %d: the fence returned after every write was visible", round)
				require.NoError(t, recv.SyncTransfers([]uint64{res.ID}, 0), "and the receiver's digests agree")
			}
		})
	}
}

// gpuOverRDMA opens a prefill and a decode guard on the NIC model and the
// CUDA model, with a GPU buffer registered on each; every transfer sends a
// notice, so the decode side can sync by transfer id.
func gpuOverRDMA(t *testing.T, sendJS string, size int) (send, recv *Guard, src, dst uint64, srcView, dstView []byte) {
	rkey := rdmaKey(t)
	ckey, m := cudaModel(t)
	send = openGuard(t, "{"+rkey+", "+ckey+`, "notify": "always"`+sendJS+"}")
	recv = openGuard(t, "{"+rkey+", "+ckey+"}")
	src, srcView = devAlloc(t, m, size)
	dst, dstView = devAlloc(t, m, size)
	require.NoError(t, send.Register(src, uint64(size)))
	require.NoError(t, recv.Register(dst, uint64(size)))
	return
}

func gpuBlocks(src, dst uint64, n, size int) []desc.Desc {
	d := make([]desc.Desc, n)
	for i := range d {
		d[i] = desc.Desc{Src: src + uint64(i*size), Dst: dst + uint64(i*size), Len: uint64(size)}
	}
	return d
}

func TestRDMAGPUToGPUInEveryMode(t *testing.T) {
	const n, size = 16, 64 << 10
	send, recv, src, dst, srcView, dstView := gpuOverRDMA(t, "", n*size)
	// Not off: a WRITE's completion is not its arrival, so over RDMA not
	// even the receiver's flush makes off safe (the next test shows the
	// flush is still needed when the bytes have arrived).
	for _, mode := range verify.Modes[1:] {
		t.Run(string(mode), func(t *testing.T) {
			fill(srcView)
			descs := gpuBlocks(src, dst, n, size)
			res, err := send.Transfer(recv.Endpoint(), descs, TransferOptions{Verify: &mode})
			require.NoError(t, err)
			require.NoError(t, recv.SyncTransfers([]uint64{res.ID}, 0))
			require.True(t, bytes.Equal(srcView, dstView), "what the decode GPU's kernels see equals the source")
		})
	}
}

func TestRDMAGPUWritesAreVisibleToKernelsOnlyAfterTheReceiversSync(t *testing.T) {
	const size = 256 << 10
	send, recv, src, dst, srcView, dstView := gpuOverRDMA(t, `, "verify": "off"`, size)
	hostSrc, hostDst := newMem(t, 64), newMem(t, 64)
	require.NoError(t, send.Register(hostSrc.addr(0), 64))
	require.NoError(t, recv.Register(hostDst.addr(0), 64))
	fill(srcView)
	_, err := send.Transfer(recv.Endpoint(), gpuBlocks(src, dst, 4, size/4), TransferOptions{})
	require.NoError(t, err)
	// A read-back of host memory on the same queue pair: once it returns,
	// the GPU writes before it have landed (a READ does not pass them) and
	// were not flushed (it read no GPU memory).
	_, err = send.Transfer(recv.Endpoint(), []desc.Desc{{Src: hostSrc.addr(0), Dst: hostDst.addr(0), Len: 64}}, TransferOptions{Verify: ptr(verify.Tail)})
	require.NoError(t, err)
	require.False(t, bytes.Equal(srcView, dstView), "GPUDirect writes have landed, and kernels may not see them yet")
	require.NoError(t, recv.Sync([]SyncRange{{dst, size}}, nil, 0))
	require.True(t, bytes.Equal(srcView, dstView), "mc_guard_sync's flush made them visible")
}

func TestRDMAGPUMemoryWithoutDmabuf(t *testing.T) {
	rkey := rdmaKey(t)
	ckey, m := cudaModel(t)
	t.Setenv("MCG_MODEL_NO_DMABUF", "1") // a device that reports DMA_BUF_SUPPORTED = 0
	g := openGuard(t, "{"+rkey+", "+ckey+"}")
	buf, _ := devAlloc(t, m, 8192)
	err := g.Register(buf, 8192)
	require.ErrorIs(t, err, errs.Device, "no dmabuf and no nvidia-peermem: GPU memory cannot be registered")
	require.Contains(t, err.Error(), "DMA_BUF_SUPPORTED = 0")
	require.Contains(t, err.Error(), "nvidia-peermem")

	t.Setenv("MCG_NIC_PEERMEM", "1") // the model reads it when a guard opens its device
	send, recv, src, dst, srcView, dstView := gpuOverRDMA(t, `, "verify": "tail"`, 8192)
	fill(srcView)
	res, err := send.Transfer(recv.Endpoint(), gpuBlocks(src, dst, 2, 4096), TransferOptions{})
	require.NoError(t, err, "with nvidia-peermem the device pointer registers as it is")
	require.NoError(t, recv.SyncTransfers([]uint64{res.ID}, 0))
	require.True(t, bytes.Equal(srcView, dstView))
}

// Striped over four queue pairs, each with its own lag and no order
// between them: every queue pair that carried writes must be fenced
// before a read-back or a digest-mode return means anything.
func TestRDMAStripedOverQueuePairs(t *testing.T) {
	key := rdmaKey(t)
	t.Setenv("MCG_NIC_LAG_US", "500000") // long enough to look before they land: each queue pair's share is one joined WRITE
	const n, size = 64, 64 << 10
	for _, flush := range []string{"0", "1"} {
		t.Run("no_flush="+flush, func(t *testing.T) {
			t.Setenv("MCG_NIC_NO_FLUSH", flush)
			p := newPair(t, "{"+key+`, "rdma_qps": 4, "verify": "off"}`, "{"+key+"}", n*size)
			require.EqualValues(t, 4, stats(t, p.send)["rdma_qps"])
			fill(p.src.b)
			_, err := p.send.Transfer(p.recv.Endpoint(), p.blocks(n, size), TransferOptions{})
			require.NoError(t, err)
			require.False(t, bytes.Equal(p.src.b, p.dst.b), "off: completed writes on four QPs, not yet visible")
			s := p.send.session(p.recv.Endpoint())
			s.mu.Lock()
			for i, n := range s.conn.(interface{ Unfenced() []int }).Unfenced() {
				require.Positive(t, n, "queue pair %d carried a share of the batch", i)
			}
			s.mu.Unlock()
			for _, mode := range []verify.Mode{verify.Tail, verify.Sample, verify.Digest} {
				fill(p.src.b)
				res, err := p.send.Transfer(p.recv.Endpoint(), p.blocks(n, size), TransferOptions{Verify: &mode})
				require.NoError(t, err, mode)
				require.True(t, bytes.Equal(p.src.b, p.dst.b), "%s: every stripe was fenced before the transfer returned", mode)
				require.Zero(t, res.Retries+res.Resends, "%s: no read-back ran ahead of a stripe's writes (none retried, none re-sent)", mode)
			}
			// One descriptor of 16 MiB: four slices, one per queue pair.
			big := newPair(t, "{"+key+`, "rdma_qps": 4, "verify": "tail"}`, "{"+key+"}", 16<<20)
			fill(big.src.b)
			_, err = big.send.Transfer(big.recv.Endpoint(), big.blocks(1, 16<<20), TransferOptions{})
			require.NoError(t, err)
			require.True(t, bytes.Equal(big.src.b, big.dst.b))
		})
	}
}

func TestRDMATooManyQueuePairsIsAConfigError(t *testing.T) {
	_, err := LoadConfig(nil, `{"rdma_qps": 17}`)
	require.ErrorIs(t, err, errs.Config)
	require.ErrorContains(t, err, "rdma_qps")
}

// A READ the remote NIC never answers (a link gone quiet) must not hold
// Close for the completion timeout: Close cancels the wait, and the
// transfer in flight fails as closed.
func TestRDMACloseCancelsAWaitOnTheNIC(t *testing.T) {
	key := rdmaKey(t)
	t.Setenv("MCG_NIC_STALL_READS", "1")
	p := newPair(t, "{"+key+`, "timeout_ms": 60000, "verify": "tail"}`, "{"+key+"}", 4096)
	fill(p.src.b)
	done := make(chan error, 1)
	go func() {
		_, err := p.send.Transfer(p.recv.Endpoint(), p.blocks(1, 4096), TransferOptions{})
		done <- err
	}()
	select {
	case err := <-done:
		t.Fatalf("the transfer returned before any READ was answered: %v", err)
	case <-time.After(300 * time.Millisecond):
	}
	start := time.Now()
	require.NoError(t, p.send.Close())
	select {
	case err := <-done:
		require.ErrorIs(t, err, errs.Closed)
		require.Less(t, time.Since(start), 5*time.Second)
	case <-time.After(10 * time.Second):
		t.Fatal("Close did not cancel the wait on the NIC")
	}
}

// transport tcp with require_rdma is a contradiction, not a quiet choice.
func TestTCPWithRequireRDMAIsAConfigError(t *testing.T) {
	_, err := LoadConfig(nil, `{"transport": "tcp", "require_rdma": true}`)
	require.ErrorIs(t, err, errs.Config)
	require.ErrorContains(t, err, `transport "tcp" and require_rdma true`)
}

// On RDMA a quiesce takes the regions away from the NIC and registers them
// again under new rkeys: WRITEs the NIC accepted land before it returns
// (deregistration waits for them), WRITEs under the old rkeys after it
// complete in error at their sender, whose next connection learns the new
// ones.
func TestRDMAQuiesceInvalidatesOldKeys(t *testing.T) {
	key := rdmaKey(t)
	t.Setenv("MCG_NIC_LAG_US", "50000")
	const n, size = 16, 4096
	p := newPair(t, "{"+key+`, "verify": "off"}`, "{"+key+"}", n*size)
	fill(p.src.b)
	_, err := p.send.Transfer(p.recv.Endpoint(), p.blocks(n, size), TransferOptions{})
	require.NoError(t, err, "accepted, not yet visible")
	start := time.Now()
	require.NoError(t, p.recv.Quiesce([]SyncRange{{p.dst.addr(0), n * size}}))
	took := time.Since(start)
	t.Logf("quiesce with writes in flight: %v", took)
	require.True(t, bytes.Equal(p.src.b, p.dst.b), "the accepted writes landed before the quiesce returned")
	for i := range p.dst.b {
		p.dst.b[i] = 0x5A
	}
	_, err = p.send.Transfer(p.recv.Endpoint(), p.blocks(n, size), TransferOptions{})
	require.Error(t, err, "a WRITE under the old rkey completes in error")
	time.Sleep(100 * time.Millisecond)
	require.Equal(t, bytes.Repeat([]byte{0x5A}, n*size), p.dst.b, "and lands nowhere")
	fill(p.src.b)
	_, err = p.send.Transfer(p.recv.Endpoint(), p.blocks(n, size), TransferOptions{Verify: ptr(verify.Tail)})
	require.NoError(t, err, "the next connection has the new rkeys")
	require.True(t, bytes.Equal(p.src.b, p.dst.b))
}

// Consecutive blocks go as one WRITE per run, and a run ends where a
// memory region ends at either side (its lkey, its rkey): blocks that
// continue across both sides' region boundaries arrive whole.
func TestRDMAJoinedWritesStayInsideRegions(t *testing.T) {
	key := rdmaKey(t)
	const n, size = 64, 4096
	p := newPair(t, "{"+key+`, "verify": "tail"}`, "{"+key+"}", n*size)
	require.NoError(t, p.send.Unregister(p.src.addr(0)))
	require.NoError(t, p.send.Register(p.src.addr(0), 5*size))
	require.NoError(t, p.send.Register(p.src.addr(5*size), (n-5)*size))
	require.NoError(t, p.recv.Unregister(p.dst.addr(0)))
	require.NoError(t, p.recv.Register(p.dst.addr(0), 40*size))
	require.NoError(t, p.recv.Register(p.dst.addr(40*size), (n-40)*size))
	for i, mode := range []verify.Mode{verify.Tail, verify.Digest} {
		fill(p.src.b)
		res, err := p.send.Transfer(p.recv.Endpoint(), p.blocks(n, size), TransferOptions{Verify: &mode})
		require.NoError(t, err, mode)
		if mode == verify.Digest {
			require.NoError(t, p.recv.SyncTransfers([]uint64{res.ID}, 0))
		}
		require.True(t, bytes.Equal(p.src.b, p.dst.b), mode)
		// Runs [0, 5), [5, 40), [40, 64): three WRITEs of 64 descriptors.
		require.EqualValues(t, (n-3)*(i+1), stats(t, p.send)["joined_descriptors"], mode)
	}
}
