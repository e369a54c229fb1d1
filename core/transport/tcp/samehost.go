package tcp

import (
	"context"
	"crypto/hmac"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"syscall"

	"github.com/mcguard/mcguard/core/logs"
	"github.com/mcguard/mcguard/core/transport"
	"github.com/mcguard/mcguard/core/transport/samehost"
	"github.com/mcguard/mcguard/core/wire"
)

// Same-host transfers: where sender and target run on one machine, in one
// pid namespace, the target copies each write straight out of the
// sender's memory with process_vm_readv instead of receiving its bytes
// through the socket. The frame that asks for it (OpWriteFrom) carries
// only the source's address and length; everything else is the TCP
// target's own: the region check, quiesce, pending writes, aborts, fault
// injection, acknowledgement after applying. The sender only lets the
// target read its memory, and the target reads only a process the kernel
// named as the sender (core/transport/samehost's identity socket), whose
// connection then proved itself: the target reads back the handshake's
// nonce at an address the sender names.

// readPeer copies [addr, addr+len(b)) of process pid into b; a test
// replaces it.
var readPeer = samehost.Read

// Why, once per process, a same-host path fell back: a sender's own writes
// to the receiver copying, a GPU source from CUDA IPC to staging.
var pushFallback, ipcFallback logs.Once

func errnoText(code uint64) string {
	switch code {
	case 0:
		return "the nonce read back did not match (not the sending process)"
	case wire.ProveNoGrant:
		return "the receiver holds no same-host grant for this handshake (forgotten, or crowded out)"
	case wire.ProveNoIdentity:
		return "the sender has not proven its process on the receiver's identity socket"
	}
	return fmt.Sprintf("process_vm_readv: %v", syscall.Errno(code))
}

// DenySameHostForTest makes every same-host copy fail with errno, as a
// kernel that forbids it would; the returned function undoes it.
func DenySameHostForTest(errno syscall.Errno) (restore func()) {
	old := readPeer
	readPeer = func(int, uint64, []byte) error { return errno }
	return func() { readPeer = old }
}

// sameHost finishes a same-host connection: the target's nonce written
// where the target can read it, and the target's word that it could. As
// setting says, a failure falls back to sending bytes (logged once) or
// fails the connection.
func (t *conn) sameHost(ctx context.Context, setting string, a handshakeAnswer) error {
	why := a.SameHostWhy
	if a.SameHost != "" {
		if why = identifyTo(ctx, a); why == "" {
			why = samehost.GrantPtrace(a.Pid)
		}
	}
	if a.SameHost != "" && why == "" {
		var slot int
		var epoch uint64
		why, slot, epoch = t.prove(ctx, a.SameHost)
		if why == "" {
			t.pull = true
			if slot >= 0 && a.LeaseNonce != "" {
				var lwhy string
				if t.lease, lwhy = samehost.AttachLease(a.Pid, a.LeaseFD, a.LeaseNonce, slot, epoch); lwhy != "" {
					logPushFallback(lwhy)
				}
			}
			// CUDA IPC needs a driver on both sides, and another process:
			// a process cannot open its own handles.
			t.ipc = a.CudaIPC && a.Pid != os.Getpid() && t.local.GPU() != nil
			return nil
		}
	} else if why == "" {
		why = "the receiver offered none"
	}
	return samehost.Decline(setting, why, t.fallbacks)
}

// identifyTo proves this process on the target's identity socket with
// the answer's nonce; it returns why not, or "".
func identifyTo(ctx context.Context, a handshakeAnswer) string {
	nonce, err := hex.DecodeString(a.SameHost)
	if err != nil || len(nonce) != samehost.NonceSize {
		return "the receiver's nonce is malformed"
	}
	return samehost.Identify(ctx, a.Identity, nonce, a.Pid)
}

// prove has the target read the nonce back out of this process; it
// returns why that failed, or "", and the lease slot the target handed
// this connection with its epoch (slot -1: none; the target copies every
// write).
func (t *conn) prove(ctx context.Context, nonceHex string) (why string, slot int, epoch uint64) {
	nonce, err := hex.DecodeString(nonceHex)
	if err != nil || len(nonce) == 0 {
		return "the receiver's nonce is malformed", -1, 0
	}
	p, err := samehost.NewProbe(nonce)
	if err != nil {
		return "no probe page: " + err.Error(), -1, 0
	}
	defer p.Free()
	defer t.abortOn(ctx)()
	h, err := t.requestAt(ctx, wire.OpProve, p.Addr(), nil)
	if err != nil {
		return err.Error(), -1, 0
	}
	if h.Status != wire.StatusOK {
		return errnoText(h.Len), -1, 0
	}
	if h.Len > samehost.MaxLeaseSlots {
		return "the receiver's lease slot is malformed", -1, 0
	}
	return "", int(h.Len) - 1, h.Addr
}

// pullSource decodes a WriteFrom frame's payload, on a connection that
// proved it comes from a same-host sender.
func (t *target) pullSource(l *link, r io.Reader, n uint64) (peerSource, wire.Status, error) {
	if n != 16 {
		_, err := io.CopyN(io.Discard, r, int64(n))
		return peerSource{}, wire.StatusBadRequest, err
	}
	var ref [16]byte
	if _, err := io.ReadFull(r, ref[:]); err != nil {
		return peerSource{}, 0, err
	}
	src := peerSource{t: t, pid: l.pid, src: binary.LittleEndian.Uint64(ref[:]), n: binary.LittleEndian.Uint64(ref[8:])}
	if l.pid == 0 || src.n == 0 || src.n > transport.MaxSlice {
		return peerSource{}, wire.StatusBadRequest, nil
	}
	return src, wire.StatusOK, nil
}

// prove reads the handshake's nonce at addr in the sender's memory: where
// it is there, this connection's writes may name source addresses. The
// reply's Len says why not, or the lease slot (slot+1; 0: none), and its
// Addr the slot's epoch.
func (t *target) prove(l *link, addr, n uint64, r io.Reader) (st wire.Status, why, epoch uint64, err error) {
	if n != 0 {
		_, err := io.CopyN(io.Discard, r, int64(n))
		return wire.StatusBadRequest, 0, 0, err
	}
	g, ok := t.grants.Get(l.sender)
	if !ok {
		return wire.StatusNoAccess, wire.ProveNoGrant, 0, nil
	}
	if g.Pid == 0 {
		return wire.StatusNoAccess, wire.ProveNoIdentity, 0, nil
	}
	got := make([]byte, len(g.Nonce))
	if err := readPeer(g.Pid, addr, got); err != nil {
		var errno syscall.Errno
		if errors.As(err, &errno) {
			return wire.StatusNoAccess, uint64(errno), 0, nil
		}
		return wire.StatusNoAccess, uint64(syscall.EIO), 0, nil
	}
	if !hmac.Equal(got, g.Nonce) {
		return wire.StatusNoAccess, 0, 0, nil
	}
	t.mu.Lock() // read by other connections' ends (samehost.IPCMaps.Drop)
	l.pid = g.Pid
	t.mu.Unlock()
	if t.lease == nil || l.ring.slot.Load() >= 0 {
		return wire.StatusOK, 0, 0, nil
	}
	slot, epoch := t.lease.Assign(l.sender, g.Pid)
	t.setRingSlot(l, slot)
	return wire.StatusOK, uint64(slot + 1), epoch, nil
}

// peerSource is [src, src+n) in process pid.
type peerSource struct {
	t      *target
	pid    int
	src, n uint64
}

// errPeerRead marks a same-host copy that failed: a refusal, not a broken
// stream.
type errPeerRead struct{ err error }

func (e errPeerRead) Error() string { return "reading the sender's memory: " + e.err.Error() }

func (s peerSource) fill(m []byte) error {
	if err := readPeer(s.pid, s.src, m); err != nil {
		return errPeerRead{err}
	}
	s.t.pulled.Add(int64(len(m)))
	return nil
}

func (peerSource) discard() error { return nil }

// settleWriters waits for the same-host senders' own writes that began
// before it (none where no lease is offered).
func (t *target) settleWriters(ctx context.Context) error {
	if t.lease == nil {
		return nil
	}
	return t.lease.Settle(ctx)
}
