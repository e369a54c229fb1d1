package tcp

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"

	"github.com/mcguard/mcguard/core/cuda"
	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/core/logs"
	"github.com/mcguard/mcguard/core/memory"
	"github.com/mcguard/mcguard/core/transport"
	"github.com/mcguard/mcguard/core/transport/samehost"
	"github.com/mcguard/mcguard/core/wire"
)

// Same-host GPU memory: where both guards have a CUDA driver, a write out
// of the sender's device memory goes as its allocation's IPC handle and
// offset (OpWriteFromDevice), and the target copies device to device on a
// stream of its own, acknowledging after the copy completed. Everything
// else is the same-host path's: only a connection that proved it comes
// from the sending process may name sources, and the rest of the write is
// the TCP target's.

// ipcSource is [ptr, ptr+n) of a sender's allocation opened here.
type ipcSource struct {
	t   *target
	m   *samehost.IPCMap
	ptr uint64
	n   uint64
	mem cuda.Memory
}

// fill stages the bytes into host memory (fault injection's buffer).
func (s ipcSource) fill(b []byte) error {
	if err := s.t.regions.GPU().CopyToHost(b, s.ptr, s.mem); err != nil {
		return fmt.Errorf("%w: copying from the peer's GPU memory: %v", errs.Device, err)
	}
	s.t.ipcBytes.Add(int64(len(b)))
	return nil
}

func (ipcSource) discard() error { return nil }

// store copies the bytes into place device to device (or to host memory).
func (s ipcSource) store(r *memory.Regions, addr, n uint64, cut func()) error {
	if err := r.StoreFromDevice(addr, n, cut, s.ptr, s.mem); err != nil {
		return err
	}
	s.t.ipcBytes.Add(int64(n))
	return nil
}

func (s ipcSource) release() { s.t.ipcs.Release(s.m) }

// pullDevice decodes a WriteFromDevice frame into dst and opens its
// source, on a connection that proved it comes from a same-host sender.
func (t *target) pullDevice(l *link, r io.Reader, dst, n uint64) (ipcSource, wire.Status, error) {
	if n != wire.IPCRefSize {
		_, err := io.CopyN(io.Discard, r, int64(n))
		return ipcSource{}, wire.StatusBadRequest, err
	}
	var ref [wire.IPCRefSize]byte
	if _, err := io.ReadFull(r, ref[:]); err != nil {
		return ipcSource{}, 0, err
	}
	var key samehost.IPCKey
	copy(key.Handle[:], ref[:cuda.IPCHandleSize])
	off := binary.LittleEndian.Uint64(ref[cuda.IPCHandleSize:])
	size := binary.LittleEndian.Uint64(ref[cuda.IPCHandleSize+8:])
	gpu := t.regions.GPU()
	// A VMM reference names the process whose descriptor the target takes:
	// only the sender this connection proved to be.
	if pid := cuda.HandleProcess(key.Handle); l.pid == 0 || gpu == nil || size == 0 || size > transport.MaxSlice || pid != 0 && pid != l.pid {
		return ipcSource{}, wire.StatusBadRequest, nil
	}
	mem, err := t.regions.Memory(dst, size)
	if err != nil {
		return ipcSource{}, wire.StatusNotRegistered, nil
	}
	key.Ordinal = mem.Ordinal // host memory: device 0
	m, err := t.ipcs.Acquire(gpu, l.pid, key)
	if err != nil {
		logs.Printf(logs.Info, "target: cannot open the sender's CUDA IPC handle (its GPU bytes come through the socket from its next connection on): %v", err)
		t.grants.RefuseIPC(l.sender)
		return ipcSource{}, wire.StatusNoAccess, nil
	}
	src := ipcSource{t: t, m: m, ptr: m.Ptr + off, n: size, mem: cuda.Memory{Device: true, Ordinal: key.Ordinal}}
	if off > m.Size || size > m.Size-off {
		src.release()
		return ipcSource{}, wire.StatusBadRequest, nil
	}
	return src, wire.StatusOK, nil
}

// sendDevice sends a device-memory slice as its IPC reference, if this
// connection uses CUDA IPC and the allocation has a handle; false if it
// must be staged instead.
func (t *conn) sendDevice(sl transport.Slice, mem cuda.Memory, m wire.Status) (bool, error) {
	if !t.ipc {
		return false, nil
	}
	ref, err := t.local.GPU().ExportIPC(sl.Src, sl.Len, mem)
	if errors.Is(err, cuda.ErrNoIPC) {
		ipcFallback.Printf(logs.Info, "same-host GPU transfers staged through the socket, not CUDA IPC: %v", err)
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("%w: %v", errs.Device, err)
	}
	var p [wire.IPCRefSize]byte
	copy(p[:], ref.Handle[:])
	binary.LittleEndian.PutUint64(p[cuda.IPCHandleSize:], ref.Offset)
	binary.LittleEndian.PutUint64(p[cuda.IPCHandleSize+8:], sl.Len)
	return true, t.send(wire.Header{Op: wire.OpWriteFromDevice, Status: m, Addr: sl.Dst, Len: uint64(len(p))}, p[:])
}
