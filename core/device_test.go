package core

import (
	"bytes"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/core/cuda/cudamodel"
	"github.com/mcguard/mcguard/core/desc"
	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/verify"
)

// cudaModel builds the software CUDA driver once and returns the config
// key that makes a guard load it, and a handle to allocate "GPU" memory.
func cudaModel(t *testing.T) (string, *cudamodel.Model) {
	t.Helper()
	cudaModelPath, err := cudamodel.Path()
	require.NoError(t, err)
	m, err := cudamodel.Open(cudaModelPath)
	require.NoError(t, err)
	return fmt.Sprintf(`"cuda": "required", "cuda_library": %q`, cudaModelPath), m
}

func devAlloc(t *testing.T, m *cudamodel.Model, n int) (uint64, []byte) {
	addr, err := m.Alloc(n)
	require.NoError(t, err)
	return addr, cudamodel.Bytes(addr, n)
}

func TestDeviceToDeviceInEveryMode(t *testing.T) {
	key, m := cudaModel(t)
	const n, size = 16, 64 << 10
	send := openGuard(t, "{"+key+"}")
	recv := openGuard(t, "{"+key+"}")
	src, srcView := devAlloc(t, m, n*size)
	dst, dstView := devAlloc(t, m, n*size)
	require.NoError(t, send.Register(src, n*size))
	require.NoError(t, recv.Register(dst, n*size))
	st := stats(t, send)
	require.Equal(t, "driver 12040", st["cuda"])
	for _, mode := range verify.Modes {
		t.Run(string(mode), func(t *testing.T) {
			fill(srcView)
			descs := make([]desc.Desc, n)
			for i := range descs {
				descs[i] = desc.Desc{Src: src + uint64(i*size), Dst: dst + uint64(i*size), Len: size}
			}
			res, err := send.Transfer(recv.Endpoint(), descs, TransferOptions{Verify: &mode})
			require.NoError(t, err)
			if mode == verify.Digest {
				require.NoError(t, recv.SyncTransfers([]uint64{res.ID}, 0))
			} else {
				ranges := make([]SyncRange, n)
				for i, d := range descs {
					ranges[i] = SyncRange{d.Dst, d.Len}
				}
				require.NoError(t, recv.Sync(ranges, nil, 0))
			}
			require.True(t, bytes.Equal(srcView, dstView), "what the decode GPU's kernels see equals the source")
			// Consecutive blocks, but a registered device region may span
			// allocations, which one device copy cannot cross: not joined.
			require.EqualValues(t, 0, stats(t, send)["joined_descriptors"])
		})
	}
}

func TestMixedHostAndDeviceBatch(t *testing.T) {
	key, m := cudaModel(t)
	const size = 8192
	send := openGuard(t, "{"+key+`, "verify": "full"}`)
	recv := openGuard(t, "{"+key+"}")
	hostSrc, hostDst := newMem(t, 2*size), newMem(t, 2*size)
	devSrc, devSrcView := devAlloc(t, m, 2*size)
	devDst, devDstView := devAlloc(t, m, 2*size)
	for _, r := range [][2]uint64{{hostSrc.addr(0), 2 * size}, {devSrc, 2 * size}} {
		require.NoError(t, send.Register(r[0], r[1]))
	}
	require.NoError(t, recv.Register(hostDst.addr(0), 2*size))
	require.NoError(t, recv.Register(devDst, 2*size))
	fill(hostSrc.b)
	fill(devSrcView)
	descs := []desc.Desc{
		{Src: hostSrc.addr(0), Dst: devDst, Len: size},                // host -> device
		{Src: devSrc, Dst: hostDst.addr(0), Len: size},                // device -> host
		{Src: devSrc + size, Dst: devDst + size, Len: size},           // device -> device
		{Src: hostSrc.addr(size), Dst: hostDst.addr(size), Len: size}, // host -> host
	}
	_, err := send.Transfer(recv.Endpoint(), descs, TransferOptions{})
	require.NoError(t, err)
	require.Equal(t, hostSrc.b[:size], devDstView[:size])
	require.Equal(t, devSrcView[:size], hostDst.b[:size])
	require.Equal(t, devSrcView[size:], devDstView[size:])
	require.Equal(t, hostSrc.b[size:], hostDst.b[size:])
}

func TestDeviceCopyFailureIsAFailedTransfer(t *testing.T) {
	key, m := cudaModel(t)
	const size = 4096
	send := openGuard(t, "{"+key+"}")
	recv := openGuard(t, "{"+key+"}")
	src, _ := devAlloc(t, m, size)
	dst, _ := devAlloc(t, m, size)
	require.NoError(t, send.Register(src, size))
	require.NoError(t, recv.Register(dst, size))
	d := []desc.Desc{{Src: src, Dst: dst, Len: size}}
	m.FailCopies(1) // the sender's staging copy of the source
	_, err := send.Transfer(recv.Endpoint(), d, TransferOptions{})
	require.ErrorIs(t, err, errs.Device)
	_, err = send.Transfer(recv.Endpoint(), d, TransferOptions{})
	require.NoError(t, err, "and then it works again")

	host := newMem(t, size)
	require.NoError(t, send.Register(host.addr(0), size))
	m.FailCopies(1) // now the target's copy into its GPU memory
	_, err = send.Transfer(recv.Endpoint(), []desc.Desc{{Src: host.addr(0), Dst: dst, Len: size}}, TransferOptions{})
	require.ErrorIs(t, err, errs.Device)
	require.Contains(t, err.Error(), "the target's GPU copy failed")
}

func TestSyncFlushesGPUDirectWrites(t *testing.T) {
	key, m := cudaModel(t)
	g := openGuard(t, "{"+key+"}")
	dst, view := devAlloc(t, m, 4096)
	require.NoError(t, g.Register(dst, 4096))
	appStream, err := m.Stream()
	require.NoError(t, err)
	for _, stream := range []uint64{0, appStream} { // the context, then the application's stream
		data := make([]byte, 4096)
		fill(data)
		require.NoError(t, m.DeferredWrite(dst, data))
		require.NotEqual(t, data, view, "a NIC's write is not yet visible to kernels")
		require.NoError(t, g.Sync([]SyncRange{{dst, 4096}}, nil, stream))
		require.Equal(t, data, view, "mc_guard_sync made it visible")
	}
}

func TestNoCUDAMeansHostOnlyAndSaysSo(t *testing.T) {
	g := openGuard(t, `{"cuda_library": "/nonexistent/libcuda.so.1"}`)
	st := stats(t, g)
	require.Contains(t, st["cuda"], "unavailable: ")
	m := newMem(t, 4096)
	require.NoError(t, g.Register(m.addr(0), 4096), "host memory works without a driver")
	err := g.RegisterDevice(m.addr(0)+8192, 4096)
	require.ErrorIs(t, err, errs.Device)
	require.Contains(t, err.Error(), "CUDA is unavailable")
	_, err = Open(testConfig(t, `{"cuda": "required", "cuda_library": "/nonexistent/libcuda.so.1"}`))
	require.ErrorIs(t, err, errs.Device)
	off := openGuard(t, `{"cuda": "off"}`)
	require.Equal(t, "off", stats(t, off)["cuda"])
}

func TestRegisterDeviceWithTheModel(t *testing.T) {
	key, m := cudaModel(t)
	g := openGuard(t, "{"+key+"}")
	dev, _ := devAlloc(t, m, 4096)
	require.NoError(t, g.RegisterDevice(dev, 4096))
	host := newMem(t, 4096)
	require.ErrorIs(t, g.RegisterDevice(host.addr(0), 4096), errs.Device, "host memory is not device memory")
}

// Digests of device memory are staged a run of ranges at a time on both
// sides; each is still the digest of its own range: a byte changed in one
// destination after it landed fails the sync naming that descriptor only.
func TestDeviceDigestsNameTheDescriptorThatDiffers(t *testing.T) {
	key, m := cudaModel(t)
	const n, size = 12, 32 << 10
	send := openGuard(t, "{"+key+`, "verify": "digest", "same_host": "off"}`)
	recv := openGuard(t, "{"+key+"}")
	src, srcView := devAlloc(t, m, n*size)
	dst, dstView := devAlloc(t, m, n*size)
	require.NoError(t, send.Register(src, n*size))
	require.NoError(t, recv.Register(dst, n*size))
	fill(srcView)
	descs := make([]desc.Desc, n)
	for i := range descs {
		descs[i] = desc.Desc{Src: src + uint64(i*size), Dst: dst + uint64(i*size), Len: size}
	}
	res, err := send.Transfer(recv.Endpoint(), descs, TransferOptions{})
	require.NoError(t, err)
	dstView[7*size+100] ^= 0xff
	err = recv.SyncTransfers([]uint64{res.ID}, 0)
	require.ErrorIs(t, err, errs.Verify)
	require.Contains(t, err.Error(), "descriptor 7")
	require.NotContains(t, err.Error(), "descriptor 6")
	require.NotContains(t, err.Error(), "descriptor 8")
}
