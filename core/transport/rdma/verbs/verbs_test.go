package verbs

import (
	"bytes"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestMissingLibraryIsAClearError(t *testing.T) {
	_, err := Load("/nonexistent/libibverbs.so.1")
	require.ErrorIs(t, err, ErrUnavailable)
	require.Contains(t, err.Error(), "cannot load /nonexistent/libibverbs.so.1")
}

func TestNotVerbsIsRefused(t *testing.T) {
	_, err := Load("libc.so.6")
	require.ErrorIs(t, err, ErrUnavailable)
	require.Contains(t, err.Error(), "lacks ibv_get_device_list")
}

// On this project's machines the kernel has no RDMA support: the probe must
// say so, not crash. On a host with a NIC it lists the active ports.
func TestProbe(t *testing.T) {
	v, err := Load("")
	if errors.Is(err, ErrUnavailable) {
		t.Skipf("libibverbs is not installed: %v", err)
	}
	require.NoError(t, err)
	ports, err := v.Ports()
	if err != nil {
		require.ErrorIs(t, err, ErrNoDevice)
		t.Logf("no RDMA devices here, as expected on a machine without a NIC: %v", err)
		_, err = Probe("")
		require.ErrorIs(t, err, ErrNoDevice)
		return
	}
	for _, p := range ports {
		require.NotEmpty(t, p.Device)
		require.Positive(t, p.Port)
	}
}

// On a host with an active RDMA port: two queue pairs of the real device
// connected to each other (loopback), WRITEs, the fence (FLUSH where the
// device has it, else a READ) and a read-back. Skipped, with the reason,
// everywhere else — which is every machine this project has.
func TestRealDeviceLoopback(t *testing.T) {
	ports, err := Probe("")
	if err != nil {
		t.Skipf("needs an RDMA device with an active port: %v", err)
	}
	v, err := Load("")
	require.NoError(t, err)
	v.ForkInit()
	a, err := v.Open(ports[0].Device, -1)
	require.NoError(t, err)
	defer a.Close()
	qa, err := a.NewQP(64)
	require.NoError(t, err)
	defer qa.Destroy()
	qb, err := a.NewQP(64)
	require.NoError(t, err)
	defer qb.Destroy()
	require.NoError(t, qa.Connect(qb.Info()))
	require.NoError(t, qb.Connect(qa.Info()))
	const n, size = 32, 64 << 10
	src, dst, back := alloc(t, n*size), alloc(t, n*size), alloc(t, n*size)
	for i := range src {
		src[i] = byte(i*7 + 1)
	}
	_, err = a.Register(src.addr(0), n*size)
	require.NoError(t, err)
	_, err = a.Register(back.addr(0), n*size)
	require.NoError(t, err)
	mr, err := a.Register(dst.addr(0), n*size)
	require.NoError(t, err)
	ws := make([]Op, n)
	for i := range ws {
		ws[i] = Op{Addr: src.addr(i * size), RemoteAddr: dst.addr(i * size), Len: size, RKey: mr.RKey}
	}
	require.NoError(t, qa.Writes(t.Context(), ws, 5*time.Second))
	if qa.CanFlush() {
		require.NoError(t, qa.Flushes(t.Context(), []Op{{RemoteAddr: dst.addr(0), Len: n * size, RKey: mr.RKey}}, 5*time.Second))
		t.Log("fenced with the FLUSH verb")
	}
	require.NoError(t, qa.Read(t.Context(), back.addr(0), dst.addr(0), mr.RKey, n*size, 5*time.Second))
	require.True(t, bytes.Equal(src, dst), "the bytes landed")
	require.True(t, bytes.Equal(src, back), "and read back")
}
