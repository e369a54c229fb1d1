package core

import (
	"bytes"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/core/desc"
	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/core/transport/tcp"
)

func pulled(t *testing.T, g *Guard) int64 {
	return int64(stats(t, g)["same_host_pulled_bytes"].(float64))
}

func pushed(t *testing.T, g *Guard) int64 {
	return int64(stats(t, g)["same_host_pushed_bytes"].(float64))
}

// By default the sender writes into the receiver itself; with
// same_host_writer "receiver" the receiver copies out of the sender.
// Either way every mode delivers every byte, and the counters say who
// copied them.
func TestSameHostEitherEndCopiesTheBytes(t *testing.T) {
	for _, writer := range []string{"sender", "receiver"} {
		t.Run(writer, func(t *testing.T) {
			p := newPair(t, `{"verify": "tail"}`, `{"same_host_writer": "`+writer+`"}`, 64*4096)
			p.moveInEveryMode(t, 64, 4096)
			all := int64(5 * 64 * 4096)
			if writer == "sender" {
				require.Equal(t, all, pushed(t, p.send), "every byte of every mode was written by the sender")
				require.Zero(t, pulled(t, p.recv))
			} else {
				require.Equal(t, all, pulled(t, p.recv), "every byte of every mode was pulled, none sent")
				require.Zero(t, pushed(t, p.send))
			}
			require.Equal(t, "auto", stats(t, p.send)["same_host"])
		})
	}
}

func TestSameHostOffSendsTheBytesThroughTheSocket(t *testing.T) {
	p := newPair(t, `{"same_host": "off"}`, "", 4*4096)
	fill(p.src.b)
	_, err := p.send.Transfer(p.session, p.blocks(4, 4096), TransferOptions{})
	require.NoError(t, err)
	require.True(t, bytes.Equal(p.src.b, p.dst.b))
	require.Zero(t, pulled(t, p.recv))
	require.Zero(t, pushed(t, p.send))

	q := newPair(t, "", `{"same_host": "off"}`, 4*4096)
	fill(q.src.b)
	_, err = q.send.Transfer(q.session, q.blocks(4, 4096), TransferOptions{})
	require.NoError(t, err, "a receiver that grants nothing: the sender falls back")
	require.Zero(t, pulled(t, q.recv))
	require.Zero(t, pushed(t, q.send))
}

// A receiver that cannot read the sender (Yama, seccomp, another user):
// auto falls back to the socket, logged once; required fails saying why.
func TestSameHostDeniedFallsBackOrFailsAsConfigured(t *testing.T) {
	restore := tcp.DenySameHostForTest(syscall.EPERM)
	defer restore()
	p := newPair(t, "", "", 4*4096)
	fill(p.src.b)
	_, err := p.send.Transfer(p.session, p.blocks(4, 4096), TransferOptions{})
	require.NoError(t, err)
	require.True(t, bytes.Equal(p.src.b, p.dst.b))
	require.Zero(t, pulled(t, p.recv))
	st := stats(t, p.send)
	require.EqualValues(t, 1, st["same_host_fallbacks"], "auto fell back, and stats say so")
	require.Contains(t, st["same_host_fallback_why"], "operation not permitted")

	q := newPair(t, `{"same_host": "required"}`, "", 4*4096)
	_, err = q.send.Transfer(q.session, q.blocks(4, 4096), TransferOptions{})
	require.ErrorIs(t, err, errs.Config)
	require.Contains(t, err.Error(), "same_host is required")
	require.Contains(t, err.Error(), "operation not permitted")
}

// Many sessions and threads at once, every destination checked.
func TestSameHostConcurrentSessions(t *testing.T) {
	const senders = 4
	recv := openGuard(t, "")
	dst := newMem(t, senders*16*4096)
	require.NoError(t, recv.Register(dst.addr(0), uint64(len(dst.b))))
	var wg sync.WaitGroup
	var sends []*Guard
	for k := 0; k < senders; k++ {
		send := openGuard(t, `{"verify": "sample"}`)
		sends = append(sends, send)
		src := newMem(t, 16*4096)
		require.NoError(t, send.Register(src.addr(0), uint64(len(src.b))))
		wg.Add(1)
		go func(k int) {
			defer wg.Done()
			for r := 0; r < 20; r++ {
				fill(src.b)
				descs := make([]desc.Desc, 16)
				for i := range descs {
					descs[i] = desc.Desc{Src: src.addr(i * 4096), Dst: dst.addr((k*16 + i) * 4096), Len: 4096}
				}
				_, err := send.Transfer(recv.Endpoint(), descs, TransferOptions{})
				require.NoError(t, err)
				require.True(t, bytes.Equal(src.b, dst.b[k*16*4096:(k+1)*16*4096]))
			}
		}(k)
	}
	wg.Wait()
	var all int64
	for _, send := range sends {
		all += pushed(t, send)
	}
	require.EqualValues(t, senders*20*16*4096, all)
}

// A sender writing into the receiver itself keeps to the receiver's
// unregister: once Unregister returns, nothing the sender still tries
// lands in the region (its later transfers fail), while the sender kept
// changing its source the whole time.
func TestSameHostUnregisterShutsOutTheSendersWrites(t *testing.T) {
	p := newPair(t, "", "", 16*4096)
	s := keepSending(t, p, p.blocks(16, 4096))
	s.until(&s.ok, 20)
	require.NoError(t, p.recv.Unregister(p.dst.addr(0)))
	after := bytes.Clone(p.dst.b)
	s.until(&s.failed, 20)
	s.stop()
	require.Equal(t, after, p.dst.b, "nothing landed after Unregister returned")
	require.Positive(t, pushed(t, p.send))
}

// sending is a sender writing fresh bytes in a loop (keepSending): its
// transfers either succeed or are refused, as unregistered or, one that
// overlaps the receiver's quiesce before it lets go of the memory (Free),
// as quiesced; any other error stops it and is kept for until to report.
type sending struct {
	t          *testing.T
	ok, failed atomic.Int64
	quit, done chan struct{}
	err        error // the unexpected error it stopped at, once done is closed
}

func keepSending(t *testing.T, p *pair, descs []desc.Desc) *sending {
	s := &sending{t: t, quit: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(s.done)
		for {
			select {
			case <-s.quit:
				return
			default:
			}
			fill(p.src.b)
			_, err := p.send.Transfer(p.session, descs, TransferOptions{})
			switch {
			case err == nil:
				s.ok.Add(1)
			case errors.Is(err, errs.NotRegistered) || errors.Is(err, errs.Quiesced):
				s.failed.Add(1)
			default:
				s.err = fmt.Errorf("transfer %d: %w", s.ok.Load()+s.failed.Load()+1, err)
				return
			}
		}
	}()
	return s
}

// until waits for a count to reach n; it fails the test where the sender
// stopped at an unexpected error, or the count does not get there in 30 s.
func (s *sending) until(count *atomic.Int64, n int64) {
	s.t.Helper()
	for end := time.Now().Add(30 * time.Second); count.Load() < n; time.Sleep(time.Millisecond) {
		select {
		case <-s.done:
			require.NoError(s.t, s.err, "the sender stopped")
			require.FailNow(s.t, "the sender stopped")
		default:
		}
		require.True(s.t, time.Now().Before(end), "%d of %d in 30 s (ok %d, refused %d)", count.Load(), n, s.ok.Load(), s.failed.Load())
	}
}

func (s *sending) stop() {
	close(s.quit)
	<-s.done
	require.NoError(s.t, s.err)
}

// Senders that come and go leave no lease slot behind: each connection's
// slot is taken back when it ends.
func TestSameHostWritersComeAndGoWithoutLeaking(t *testing.T) {
	recv := openGuard(t, "")
	dst := newMem(t, 4096)
	require.NoError(t, recv.Register(dst.addr(0), 4096))
	for i := 0; i < 40; i++ {
		send := openGuard(t, "")
		src := newMem(t, 4096)
		require.NoError(t, send.Register(src.addr(0), 4096))
		fill(src.b)
		_, err := send.Transfer(recv.Endpoint(), []desc.Desc{{Src: src.addr(0), Dst: dst.addr(0), Len: 4096}}, TransferOptions{})
		require.NoError(t, err)
		require.Equal(t, src.b, dst.b)
		require.Positive(t, pushed(t, send))
		send.Close()
	}
	require.Eventually(t, func() bool { return stats(t, recv)["same_host_writers"].(float64) == 0 },
		5*time.Second, 10*time.Millisecond, "every slot is free once its sender left")
}

// Several senders write into the receiver themselves while the receiver
// unregisters and registers its regions over and over: while a region is
// out of the table, the bytes the receiver put there (a canary) must stay
// untouched, whatever the senders are doing.
func TestSameHostUnregisterUnderConcurrentSenders(t *testing.T) {
	const regions, size, senders, cycles = 4, 16 * 4096, 3, 60
	recv := openGuard(t, "")
	dst := newMem(t, regions*size)
	base := func(r int) uint64 { return dst.addr(r * size) }
	for r := 0; r < regions; r++ {
		require.NoError(t, recv.Register(base(r), size))
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var landed atomic.Int64
	var sends []*Guard
	for k := 0; k < senders; k++ {
		send := openGuard(t, "")
		sends = append(sends, send)
		src := newMem(t, size)
		require.NoError(t, send.Register(src.addr(0), size))
		fill(src.b)
		wg.Add(1)
		go func(k int) {
			defer wg.Done()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				r := (i + k) % regions
				descs := make([]desc.Desc, 16)
				for j := range descs {
					descs[j] = desc.Desc{Src: src.addr(j * 4096), Dst: base(r) + uint64(j*4096), Len: 4096}
				}
				if _, err := send.Transfer(recv.Endpoint(), descs, TransferOptions{}); err == nil {
					landed.Add(1)
				} else if !errors.Is(err, errs.NotRegistered) && !errors.Is(err, errs.Verify) {
					// Refused while out of the table, or written and then
					// overwritten by the receiver's canary before its
					// read-back: a failure seen, never a success.
					t.Errorf("a transfer failed otherwise than refused or caught: %v", err)
				}
			}
		}(k)
	}
	canary := bytes.Repeat([]byte{0x5a}, size)
	for c := 0; c < cycles; c++ {
		r := c % regions
		region := dst.b[r*size : (r+1)*size]
		require.NoError(t, recv.Unregister(base(r)))
		copy(region, canary)
		time.Sleep(2 * time.Millisecond) // the senders go on meanwhile
		require.Equal(t, canary, region, "cycle %d: nothing may land in region %d while it is unregistered", c, r)
		require.NoError(t, recv.Register(base(r), size))
	}
	close(stop)
	wg.Wait()
	require.Positive(t, landed.Load(), "the senders did write between the cycles")
	var all int64
	for _, send := range sends {
		all += pushed(t, send)
	}
	require.Positive(t, all, "the senders wrote into the receiver themselves")
}

// A sender that injects a receiver's faults itself draws a fresh stream of
// fates on each connection: a failed transfer drops its connection, and a
// new one that replayed the same stream failed the same transfer of every
// connection (with one write a transfer: all, or every second one).
func TestSameHostInjectedFaultsDoNotRepeatPerConnection(t *testing.T) {
	p := newPair(t, `{"verify": "tail", "max_retries": 0, "same_host": "required"}`,
		`{"inject": "drop", "inject_rate": 0.5, "inject_seed": 7}`, 4096)
	var outcome []bool
	for i := 0; i < 48; i++ {
		fill(p.src.b)
		_, err := p.send.Transfer(p.session, p.blocks(1, 4096), TransferOptions{})
		if err != nil {
			require.ErrorIs(t, err, errs.Verify)
		}
		outcome = append(outcome, err == nil)
	}
	require.Positive(t, pushed(t, p.send), "the sender wrote, injecting the drops")
	periodic := func(k int) bool {
		for i := k; i < len(outcome); i++ {
			if outcome[i] != outcome[i-k] {
				return false
			}
		}
		return true
	}
	for k := 1; k <= 4; k++ {
		require.False(t, periodic(k), "outcomes repeat every %d transfers: %v", k, outcome)
	}
}
