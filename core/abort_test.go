package core

import (
	"bytes"
	"io"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/core/auth"
	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/core/wire"
)

// heldWrite binds a raw data connection to recv and sends one write of
// fill into m, which the receiver's hold fault keeps back: bytes still on
// their way when the receiver decides to reuse m.
func heldWrite(t *testing.T, recv *Guard, m *mem, fill byte) net.Conn {
	c := dataConn(t, recv, shakeHands(t, recv, auth.RandomBytes(auth.NonceSize)))
	c.Write(frame(wire.Header{Op: wire.OpWrite, ID: 2, Addr: m.addr(0), Len: uint64(len(m.b))}, bytes.Repeat([]byte{fill}, len(m.b))))
	return c
}

const holdJS = `{"inject": "hold", "inject_rate": 1, "inject_lag_max_ms": 300, "inject_seed": 4}`

// The abort hole: a write still on its way lands after the receiver gave
// its memory to another request. With a quiesce before the reuse it is
// refused when it arrives; without one it overwrites the new request's bytes.
func TestQuiesceRefusesAWriteStillOnItsWay(t *testing.T) {
	for _, quiesce := range []bool{false, true} {
		m := newMem(t, 4096) // first: the guard closes before the memory goes
		recv := openGuard(t, holdJS)
		require.NoError(t, recv.Register(m.addr(0), 4096))
		c := heldWrite(t, recv, m, 0xEE)
		defer c.Close()
		time.Sleep(20 * time.Millisecond) // the target has the write in hand
		if quiesce {
			start := time.Now()
			require.NoError(t, recv.Quiesce([]SyncRange{{m.addr(0), 4096}}))
			require.Less(t, time.Since(start), 100*time.Millisecond, "nothing in progress to wait for")
		}
		for i := range m.b {
			m.b[i] = 0x5A // the next request's bytes
		}
		time.Sleep(400 * time.Millisecond)
		if quiesce {
			require.Equal(t, bytes.Repeat([]byte{0x5A}, 4096), m.b, "the late write was refused")
			reply := make([]byte, wire.HeaderSize)
			h := wire.Header{Op: wire.OpMark}
			for h.Op == wire.OpMark { // the quiesce pushed to the connection first
				_, err := io.ReadFull(c, reply)
				require.NoError(t, err)
				h, _ = wire.Decode(reply)
			}
			require.Equal(t, wire.StatusQuiesced, h.Status, "and its sender is told so")
		} else {
			require.Equal(t, bytes.Repeat([]byte{0xEE}, 4096), m.b, "without a quiesce the late write lands on the reused memory")
		}
	}
}

// Writes sent after a quiesce are taken: the target pushes the quiesce to
// an idle sender's connection, which echoes it before its next writes.
func TestWritesAfterAQuiesceAreTaken(t *testing.T) {
	p := newPair(t, "", "", 16*4096)
	fill(p.src.b)
	_, err := p.send.Transfer(p.recv.Endpoint(), p.blocks(16, 4096), TransferOptions{})
	require.NoError(t, err)
	require.NoError(t, p.recv.Quiesce([]SyncRange{{p.dst.addr(0), 16 * 4096}}))
	time.Sleep(20 * time.Millisecond)
	for round := 0; round < 3; round++ {
		fill(p.src.b)
		_, err = p.send.Transfer(p.recv.Endpoint(), p.blocks(16, 4096), TransferOptions{})
		require.NoError(t, err, "round %d", round)
		require.True(t, bytes.Equal(p.src.b, p.dst.b))
		require.NoError(t, p.recv.Quiesce([]SyncRange{{p.dst.addr(4096), 4096}}))
		time.Sleep(20 * time.Millisecond)
	}
	require.EqualValues(t, 4, stats(t, p.recv)["quiesces"])
	require.Error(t, p.recv.Quiesce([]SyncRange{{p.dst.addr(0) + 1<<30, 8}}), "an unregistered range")
}

// A cancelled or timed-out transfer returns once its writes are cut off,
// and the receiver confirms nothing more of them lands, even the one it
// already had in hand.
func TestCancelAndDeadlineCutOffAndConfirm(t *testing.T) {
	for _, how := range []string{"cancel", "deadline"} {
		t.Run(how, func(t *testing.T) {
			p := newPair(t, `{"verify": "off"}`, holdJS, 4096)
			fill(p.src.b)
			opts := TransferOptions{}
			if how == "deadline" {
				opts.Deadline = 50 * time.Millisecond
			} else {
				go func() {
					time.Sleep(50 * time.Millisecond)
					p.send.Cancel(p.recv.Endpoint())
				}()
			}
			start := time.Now()
			res, err := p.send.Transfer(p.recv.Endpoint(), p.blocks(1, 4096), opts)
			require.Error(t, err)
			if how == "deadline" {
				require.ErrorIs(t, err, errs.Timeout)
			} else {
				require.ErrorIs(t, err, errs.Cancelled)
			}
			require.Less(t, time.Since(start), 250*time.Millisecond, "it did not wait for the held write")
			require.Equal(t, AbortConfirmed, res.Abort)
			for i := range p.dst.b {
				p.dst.b[i] = 0x5A
			}
			time.Sleep(400 * time.Millisecond)
			require.Equal(t, bytes.Repeat([]byte{0x5A}, 4096), p.dst.b, "nothing of the aborted transfer landed")
			require.EqualValues(t, 1, stats(t, p.send)["aborts_confirmed"])
			require.EqualValues(t, 1, stats(t, p.recv)["aborts_answered"])
		})
	}
}

// An abort the receiver cannot confirm says so.
func TestAbortUnconfirmedWhenTheReceiverIsGone(t *testing.T) {
	p := newPair(t, `{"verify": "off", "connect_timeout_ms": 200}`, holdJS, 4096)
	fill(p.src.b)
	go func() {
		time.Sleep(50 * time.Millisecond)
		p.recv.Close()
	}()
	res, err := p.send.Transfer(p.recv.Endpoint(), p.blocks(1, 4096), TransferOptions{Deadline: 2 * time.Second})
	require.Error(t, err)
	require.Equal(t, AbortUnconfirmed, res.Abort)
}

// A data connection whose handshake predates a quiesce is sent the mark
// when its hello is taken, and after its echo its writes go through: it
// is never left behind (a quiesce marks only the connections bound then).
func TestAConnectionBoundAfterAQuiesceCatchesUp(t *testing.T) {
	m := newMem(t, 4096)
	recv := openGuard(t, "")
	require.NoError(t, recv.Register(m.addr(0), 4096))
	hello := shakeHands(t, recv, auth.RandomBytes(auth.NonceSize)) // the generation before the quiesce
	require.NoError(t, recv.Quiesce([]SyncRange{{m.addr(0), 4096}}))
	c := dataConn(t, recv, hello)
	defer c.Close()
	hdr := make([]byte, wire.HeaderSize)
	c.SetReadDeadline(time.Now().Add(2 * time.Second))
	_, err := io.ReadFull(c, hdr)
	require.NoError(t, err)
	mark, err := wire.Decode(hdr)
	require.NoError(t, err)
	require.Equal(t, wire.OpMark, mark.Op, "the mark follows the hello's reply")
	write := func(id uint64) wire.Status {
		c.Write(frame(wire.Header{Op: wire.OpWrite, ID: id, Addr: m.addr(0), Len: 8}, []byte("GOTHERE!")))
		_, err := io.ReadFull(c, hdr)
		require.NoError(t, err)
		h, _ := wire.Decode(hdr)
		return h.Status
	}
	require.Equal(t, wire.StatusQuiesced, write(2), "before the echo: refused")
	c.Write(frame(wire.Header{Op: wire.OpMark, ID: 3, Addr: mark.Addr}, nil))
	_, err = io.ReadFull(c, hdr)
	require.NoError(t, err)
	require.Equal(t, wire.StatusOK, write(4), "after it: taken")
	require.Equal(t, []byte("GOTHERE!"), m.b[:8])
}
