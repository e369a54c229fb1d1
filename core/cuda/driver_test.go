package cuda_test

import (
	"bytes"
	"errors"
	"syscall"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/core/cuda"
	"github.com/mcguard/mcguard/core/cuda/cudamodel"
)

var modelPath string

// model builds the software driver (once per test binary) and loads it.
func model(t *testing.T) (*cuda.Driver, *cudamodel.Model) {
	t.Helper()
	var err error
	modelPath, err = cudamodel.Path()
	require.NoError(t, err)
	d, err := cuda.Load(modelPath)
	require.NoError(t, err)
	m, err := cudamodel.Open(modelPath)
	require.NoError(t, err)
	return d, m
}

func TestNoDriverIsAClearError(t *testing.T) {
	_, err := cuda.Load("/nonexistent/libcuda.so.1")
	require.ErrorIs(t, err, cuda.ErrUnavailable)
	require.Contains(t, err.Error(), "cannot load /nonexistent/libcuda.so.1")
}

func TestRealDriver(t *testing.T) {
	d, err := cuda.Load("")
	if errors.Is(err, cuda.ErrUnavailable) {
		t.Skipf("no CUDA driver on this machine: %v", err)
	}
	require.NoError(t, err)
	require.GreaterOrEqual(t, d.Version, 11030)
	host := make([]byte, 64)
	m, err := d.Classify(uint64(uintptr(unsafe.Pointer(&host[0]))))
	require.NoError(t, err)
	require.False(t, m.Device, "Go memory is host memory")
}

func TestModelRefusesOldDriversAndMissingDevices(t *testing.T) {
	model(t)
	t.Setenv("MCG_MODEL_NO_DEVICE", "1")
	_, err := cuda.Load(modelPath)
	require.ErrorIs(t, err, cuda.ErrUnavailable)
	require.Contains(t, err.Error(), "cuInit failed")
	t.Setenv("MCG_MODEL_NO_DEVICE", "0")
	t.Setenv("MCG_MODEL_DRIVER_VERSION", "11020")
	_, err = cuda.Load(modelPath)
	require.ErrorContains(t, err, "needs 11030")
	t.Setenv("MCG_MODEL_DRIVER_VERSION", "12040")
	_, err = cuda.Load(modelPath)
	require.NoError(t, err)
}

func TestClassify(t *testing.T) {
	d, m := model(t)
	dev, err := m.Alloc(4096)
	require.NoError(t, err)
	got, err := d.Classify(dev + 100)
	require.NoError(t, err)
	require.Equal(t, cuda.Memory{Device: true, Ordinal: 0}, got)
	host, err := syscall.Mmap(-1, 0, 4096, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
	require.NoError(t, err)
	defer syscall.Munmap(host)
	got, err = d.Classify(uint64(uintptr(unsafe.Pointer(&host[0]))))
	require.NoError(t, err)
	require.False(t, got.Device)
}

func TestCopiesThroughStaging(t *testing.T) {
	d, m := model(t)
	const n = 9<<20 + 17 // more than two staging buffers
	dev, err := m.Alloc(n)
	require.NoError(t, err)
	src := make([]byte, n)
	for i := range src {
		src[i] = byte(i * 13)
	}
	mem := cuda.Memory{Device: true}
	require.NoError(t, d.CopyToDevice(dev, src, mem))
	require.True(t, bytes.Equal(src, cudamodel.Bytes(dev, n)), "the copy completed before CopyToDevice returned")
	back := make([]byte, n)
	require.NoError(t, d.CopyToHost(back, dev, mem))
	require.True(t, bytes.Equal(src, back))
}

func TestSettleIsNeededAndEnough(t *testing.T) {
	d, m := model(t)
	dev, err := m.Alloc(4096)
	require.NoError(t, err)
	data := bytes.Repeat([]byte{0x42}, 4096)
	require.NoError(t, m.DeferredWrite(dev, data))
	require.NotEqual(t, data, cudamodel.Bytes(dev, 4096), "before the flush a kernel sees old bytes")
	require.NoError(t, d.Settle(0, 0))
	require.Equal(t, data, cudamodel.Bytes(dev, 4096), "after it, the new ones")
}

func TestCopyFailureIsAnError(t *testing.T) {
	d, m := model(t)
	dev, err := m.Alloc(4096)
	require.NoError(t, err)
	m.FailCopies(1)
	err = d.CopyToDevice(dev, make([]byte, 4096), cuda.Memory{Device: true})
	require.ErrorIs(t, err, cuda.ErrDevice)
	require.Contains(t, err.Error(), "CUDA_ERROR_ILLEGAL_ADDRESS")
	require.NoError(t, d.CopyToDevice(dev, make([]byte, 4096), cuda.Memory{Device: true}), "the next copy works")
}

func TestDmabufExportsTheWholeAllocation(t *testing.T) {
	d, m := model(t)
	const n = 3*4096 + 100 // not a whole number of pages
	dev, err := m.Alloc(n)
	require.NoError(t, err)
	mem := cuda.Memory{Device: true}
	fd, offset, err := d.Dmabuf(dev+4096+8, 2000, mem)
	require.NoError(t, err)
	defer syscall.Close(fd)
	require.EqualValues(t, 4096+8, offset, "the offset of the range in the exported allocation")
	_, err = fdFlags(fd)
	require.NoError(t, err, "a file descriptor the caller owns")

	_, _, err = d.Dmabuf(dev+n-10, 4096, mem)
	require.ErrorIs(t, err, cuda.ErrDevice, "a range past its allocation")

	t.Setenv("MCG_MODEL_NO_DMABUF", "1")
	_, _, err = d.Dmabuf(dev, 4096, mem)
	require.ErrorIs(t, err, cuda.ErrNoDmabuf)
	require.Contains(t, err.Error(), "DMA_BUF_SUPPORTED = 0")
}

func fdFlags(fd int) (int, error) {
	r, _, errno := syscall.Syscall(syscall.SYS_FCNTL, uintptr(fd), syscall.F_GETFD, 0)
	if errno != 0 {
		return 0, errno
	}
	return int(r), nil
}
