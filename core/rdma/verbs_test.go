package rdma

import (
	"errors"
	"testing"

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
