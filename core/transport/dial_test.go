package transport

import (
	"context"
	"net"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// fullListener listens on loopback with an accept queue of one and fills
// it, so that the kernel drops the next SYNs until accept drains it.
func fullListener(t *testing.T) (net.Listener, net.Conn) {
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM, 0)
	require.NoError(t, err)
	require.NoError(t, syscall.Bind(fd, &syscall.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}))
	require.NoError(t, syscall.Listen(fd, 0))
	f := os.NewFile(uintptr(fd), "listener")
	ln, err := net.FileListener(f)
	f.Close()
	require.NoError(t, err)
	t.Cleanup(func() { ln.Close() })
	queued, err := net.DialTimeout("tcp", ln.Addr().String(), time.Second)
	require.NoError(t, err)
	t.Cleanup(func() { queued.Close() })
	return ln, queued
}

// A connect whose SYN is dropped (the listener's queue full) is started
// afresh within the deadline, and gets in once the queue drains, where the
// kernel's own retry would come a second after the first SYN.
func TestConnectStartsAfreshWhenItsSYNIsDropped(t *testing.T) {
	ln, _ := fullListener(t)
	go func() {
		time.Sleep(100 * time.Millisecond)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			defer c.Close()
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 900*time.Millisecond)
	defer cancel()
	c, err := Connect(ctx, ln.Addr().String())
	require.NoError(t, err, "a fresh connect after the queue drained")
	c.Close()
}

// A refusal ends Connect at once, and a silent address at ctx's end.
func TestConnectEndsAtRefusalOrDeadline(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := ln.Addr().String()
	ln.Close()
	start := time.Now()
	_, err = Connect(context.Background(), addr)
	require.ErrorIs(t, err, syscall.ECONNREFUSED)
	require.Less(t, time.Since(start), firstConnectWait, "no retry after a refusal")

	full, _ := fullListener(t) // never accepts
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	_, err = Connect(ctx, full.Addr().String())
	require.Error(t, err)
	require.Error(t, ctx.Err(), "it waited for the deadline")
}
