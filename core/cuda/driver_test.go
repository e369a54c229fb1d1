package cuda_test

import (
	"bytes"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"syscall"
	"testing"
	"unsafe"

	"github.com/mcguard/mcguard/core/internal/testmem"

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
	host := testmem.Map(t, 4096)
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

// Many ranges staged together, small ones and ones that cross staging
// buffers, land one after another in order.
func TestCopiesRangesThroughStagingTogether(t *testing.T) {
	d, m := model(t)
	const n = 12 << 20
	dev, err := m.Alloc(n)
	require.NoError(t, err)
	src := make([]byte, n)
	_, _ = rand.Read(src)
	mem := cuda.Memory{Device: true}
	require.NoError(t, d.CopyToDevice(dev, src, mem))
	var srcs, lens []uint64
	var want []byte
	for _, r := range [][2]uint64{{0, 64}, {4096, 64}, {1 << 20, 3<<20 + 5}, {8 << 20, 1}, {5 << 20, 4 << 20}, {n - 64, 64}} {
		srcs, lens = append(srcs, dev+r[0]), append(lens, r[1])
		want = append(want, src[r[0]:r[0]+r[1]]...)
	}
	got := make([]byte, len(want))
	require.NoError(t, d.CopyRangesToHost(got, srcs, lens, mem))
	require.True(t, bytes.Equal(want, got))
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

// TestIPCAcrossProcesses: a child process opens this process's IPC
// handle, copies the bytes device to device into its own allocation and
// back to host for a hash, and writes into this process's memory through
// the handle.
func TestIPCAcrossProcesses(t *testing.T) {
	t.Run("legacy", func(t *testing.T) { ipcAcrossProcesses(t, false) })
	t.Run("vmm", func(t *testing.T) {
		t.Setenv("MCG_MODEL_VMM", "1") // the child inherits it
		ipcAcrossProcesses(t, true)
	})
}

// ipcAcrossProcesses runs the test on memory with a legacy IPC handle, or
// on VMM memory shared as a file descriptor (vmm).
func ipcAcrossProcesses(t *testing.T, vmm bool) {
	d, m := model(t)
	const n = 1 << 20
	src, err := m.Alloc(n)
	require.NoError(t, err)
	data := make([]byte, n)
	rand.Read(data)
	copy(cudamodel.Bytes(src, n), data)
	mem, err := d.Classify(src)
	require.NoError(t, err)
	ref, err := d.ExportIPC(src+4096, 8192, mem)
	require.NoError(t, err)
	require.EqualValues(t, 4096, ref.Offset)
	again, err := d.ExportIPC(src, n, mem)
	require.NoError(t, err)
	require.Equal(t, ref.Handle, again.Handle, "one handle per allocation")

	require.Equal(t, map[bool]int{false: 0, true: os.Getpid()}[vmm], cuda.HandleProcess(ref.Handle), "a VMM reference names its process")
	if !vmm {
		_, _, err = d.OpenIPC(ref.Handle, 0)
		require.ErrorIs(t, err, cuda.ErrDevice, "a process cannot open its own handle")
	}
	_, err = d.ExportIPC(src+n-8, 16, mem)
	require.ErrorContains(t, err, "not inside one device allocation")

	cmd := exec.Command(os.Args[0], "-test.run=^TestIPCChild$", "-test.v")
	cmd.Env = append(os.Environ(), "MCG_IPC_CHILD="+hex.EncodeToString(ref.Handle[:]), fmt.Sprintf("MCG_IPC_CHILD_OFFSET=%d", ref.Offset))
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "%s", out)
	sum := sha256.Sum256(data[4096 : 4096+8192])
	require.Contains(t, string(out), "child sha256 "+hex.EncodeToString(sum[:]), "the child copied this process's bytes")
	require.Equal(t, bytes.Repeat([]byte{0xab}, 512), cudamodel.Bytes(src, 512), "the child's write through the handle landed here")

	// A freed allocation's cached handle is not handed out for a new one.
	require.NoError(t, m.Free(src))
	src2, err := m.Alloc(n)
	require.NoError(t, err)
	mem2, err := d.Classify(src2)
	require.NoError(t, err)
	ref2, err := d.ExportIPC(src2, n, mem2)
	require.NoError(t, err)
	require.NotEqual(t, ref.Handle, ref2.Handle, "a new allocation (buffer id) has a new handle, even at the same base")
}

// TestIPCChild is TestIPCAcrossProcesses's child process.
func TestIPCChild(t *testing.T) {
	h := os.Getenv("MCG_IPC_CHILD")
	if h == "" {
		t.Skip("the child process of TestIPCAcrossProcesses; runs only as that")
	}
	d, m := model(t)
	raw, err := hex.DecodeString(h)
	require.NoError(t, err)
	var handle [cuda.IPCHandleSize]byte
	copy(handle[:], raw)
	off, err := strconv.ParseUint(os.Getenv("MCG_IPC_CHILD_OFFSET"), 10, 64)
	require.NoError(t, err)
	ptr, size, err := d.OpenIPC(handle, 0)
	require.NoError(t, err)
	require.EqualValues(t, 1<<20, size)
	if cuda.HandleProcess(handle) == 0 {
		_, _, err = d.OpenIPC(handle, 0)
		require.ErrorContains(t, err, "ALREADY_MAPPED", "a legacy handle opens once per process")
	}
	mine, err := m.Alloc(8192)
	require.NoError(t, err)
	dev := cuda.Memory{Device: true}
	require.NoError(t, d.CopyDeviceToDevice(mine, ptr+off, 8192, dev))
	got := make([]byte, 8192)
	require.NoError(t, d.CopyToHost(got, mine, dev))
	sum := sha256.Sum256(got)
	fmt.Printf("child sha256 %x\n", sum)
	require.NoError(t, d.CopyToDevice(mine, bytes.Repeat([]byte{0xab}, 512), dev))
	require.NoError(t, d.CopyDeviceToDevice(ptr, mine, 512, dev))
	require.NoError(t, d.CloseIPC(ptr, 0))
	require.Error(t, d.CloseIPC(ptr, 0), "closed once")
}

// VMM memory created without a shareable handle type cannot be shared: it
// is staged, saying why.
func TestVMMMemoryWithoutAShareableHandleIsNotExported(t *testing.T) {
	d, m := model(t)
	t.Setenv("MCG_MODEL_NO_LEGACY_IPC", "1")
	src, err := m.Alloc(8192)
	require.NoError(t, err)
	mem, err := d.Classify(src)
	require.NoError(t, err)
	_, err = d.ExportIPC(src, 8192, mem)
	require.ErrorIs(t, err, cuda.ErrNoIPC)
	require.ErrorContains(t, err, "not created shareable")
}
