package verbs

import (
	"bytes"
	"crypto/rand"
	"testing"
	"time"
	"unsafe"

	"github.com/mcguard/mcguard/core/internal/testmem"

	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/core/internal/models"
)

type mmapMem []byte

func alloc(t *testing.T, n int) mmapMem {
	return testmem.Map(t, n)
}

func (m mmapMem) addr(off int) uint64 { return uint64(uintptr(unsafe.Pointer(&m[off]))) }

// pair is two endpoints of the model with a queue pair each, connected to
// each other: a sender (a) and a target (b).
type pair struct {
	a, b   *Endpoint
	qa, qb *QP
}

func newPair(t *testing.T, env map[string]string) *pair {
	path := models.NICFor(t)
	for k, v := range env {
		t.Setenv(k, v) // the model reads its knobs when devices are listed
	}
	v, err := Load(path)
	require.NoError(t, err)
	p := &pair{}
	p.a, err = v.Open("", -1)
	require.NoError(t, err)
	p.b, err = v.Open("mcgnic0", 0)
	require.NoError(t, err)
	p.qa, err = p.a.NewQP(64)
	require.NoError(t, err)
	p.qb, err = p.b.NewQP(64)
	require.NoError(t, err)
	require.NoError(t, p.qa.Connect(p.qb.Info()))
	require.NoError(t, p.qb.Connect(p.qa.Info()))
	t.Cleanup(func() {
		p.qa.Destroy()
		p.qb.Destroy()
		p.a.Close()
		p.b.Close()
	})
	return p
}

// buffers allocates a source registered at the sender and a destination
// registered at the target (its MR returned), the source filled at random.
func (p *pair) buffers(t *testing.T, srcLen, dstLen int) (src, dst mmapMem, mr *MR) {
	src, dst = alloc(t, srcLen), alloc(t, dstLen)
	rand.Read(src)
	_, err := p.a.Register(src.addr(0), uint64(srcLen))
	require.NoError(t, err)
	mr, err = p.b.Register(dst.addr(0), uint64(dstLen))
	require.NoError(t, err)
	return src, dst, mr
}

func TestModelRunsTheRealLoader(t *testing.T) {
	v, err := Load(models.NICFor(t))
	require.NoError(t, err)
	ports, err := activePorts(v)
	require.NoError(t, err)
	require.Equal(t, []Port{{Device: "mcgnic0", Port: 1, Active: true, RoCE: true, ActiveMTU: 5}}, ports)
}

func TestQPStateMachine(t *testing.T) {
	p := newPair(t, nil)
	require.Error(t, p.qa.Connect(p.qb.Info()), "RTS -> INIT is not a transition")
	q, err := p.a.NewQP(8)
	require.NoError(t, err)
	defer q.Destroy()
	require.Error(t, q.Connect(QPInfo{QPN: 1}), "a GID no NIC answers to")
}

func TestWriteThenFencedReadDeliversBytes(t *testing.T) {
	p := newPair(t, nil)
	const n, size = 100, 4096 // more than the queue depth: several chains
	src, dst, scratch := alloc(t, n*size), alloc(t, n*size), alloc(t, n*size)
	rand.Read(src)
	_, err := p.a.Register(src.addr(0), n*size)
	require.NoError(t, err)
	_, err = p.a.Register(scratch.addr(0), n*size)
	require.NoError(t, err)
	mr, err := p.b.Register(dst.addr(0), n*size)
	require.NoError(t, err)
	ws := make([]Op, n)
	for i := range ws {
		ws[i] = Op{Addr: src.addr(i * size), RemoteAddr: dst.addr(i * size), Len: size, RKey: mr.RKey}
	}
	require.NoError(t, p.qa.Writes(t.Context(), ws, 5*time.Second))
	require.NoError(t, p.qa.Read(t.Context(), scratch.addr(0), dst.addr(0), mr.RKey, n*size, 5*time.Second))
	require.True(t, bytes.Equal(src, dst))
	require.True(t, bytes.Equal(src, scratch), "the read-back returns the target's bytes")
}

// Each fence, a READ and a FLUSH, on the QP that carried the writes.
func TestCompletionComesBeforeVisibilityAndTheFenceMakesItVisible(t *testing.T) {
	const size = 64 << 10
	fences := map[string]func(p *pair, scratch uint64, mr *MR, dst mmapMem) error{
		"read": func(p *pair, scratch uint64, mr *MR, dst mmapMem) error {
			return p.qa.Read(t.Context(), scratch, dst.addr(0), mr.RKey, 64, 5*time.Second)
		},
		"flush": func(p *pair, _ uint64, mr *MR, dst mmapMem) error {
			require.True(t, p.qa.CanFlush(), "the model's device and provider do the FLUSH verb")
			return p.qa.Flushes(t.Context(), []Op{{RemoteAddr: dst.addr(0), Len: size, RKey: mr.RKey}}, 5*time.Second)
		},
	}
	for name, fence := range fences {
		t.Run(name, func(t *testing.T) {
			p := newPair(t, map[string]string{"MCG_NIC_LAG_US": "200000"})
			src, dst, scratch := alloc(t, size), alloc(t, size), alloc(t, 64)
			rand.Read(src)
			_, err := p.a.Register(src.addr(0), size)
			require.NoError(t, err)
			_, err = p.a.Register(scratch.addr(0), 64)
			require.NoError(t, err)
			mr, err := p.b.Register(dst.addr(0), size)
			require.NoError(t, err)
			for i := 0; i < 8; i++ {
				ws := []Op{{Addr: src.addr(i * size / 8), RemoteAddr: dst.addr(i * size / 8), Len: size / 8, RKey: mr.RKey}}
				require.NoError(t, p.qa.Writes(t.Context(), ws, 5*time.Second))
			}
			require.False(t, bytes.Equal(src, dst), "the writes completed, and their bytes are not all there yet")
			require.NoError(t, fence(p, scratch.addr(0), mr, dst))
			require.True(t, bytes.Equal(src, dst), "the fence on the same QP returns after its earlier writes are visible")
		})
	}
}

func TestErrorsCompleteInErrorAndTheQPReconnects(t *testing.T) {
	p := newPair(t, nil)
	src, dst, mr := p.buffers(t, 8192, 4096)

	err := p.qa.Writes(t.Context(), []Op{{Addr: src.addr(0), RemoteAddr: dst.addr(0), Len: 8192, RKey: mr.RKey}}, 5*time.Second)
	require.ErrorIs(t, err, ErrCompletion)
	require.Contains(t, err.Error(), "remote access error")
	require.Equal(t, make([]byte, 4096), []byte(dst), "nothing landed")
	err = p.qa.Writes(t.Context(), []Op{{Addr: src.addr(0), RemoteAddr: dst.addr(0), Len: 64, RKey: mr.RKey}}, time.Second)
	require.Error(t, err, "a QP in the error state takes no work")

	require.NoError(t, p.qa.Reconnect())
	require.NoError(t, p.qa.Writes(t.Context(), []Op{{Addr: src.addr(0), RemoteAddr: dst.addr(0), Len: 4096, RKey: mr.RKey}}, 5*time.Second))
	require.NoError(t, p.qa.Read(t.Context(), src.addr(4096), dst.addr(0), mr.RKey, 4096, 5*time.Second))
	require.True(t, bytes.Equal(src[:4096], dst), "after the reconnect the write lands")
	require.True(t, bytes.Equal(src[4096:], dst), "and reads back")

	err = p.qa.Writes(t.Context(), []Op{{Addr: src.addr(0) + 1<<20, RemoteAddr: dst.addr(0), Len: 64, RKey: mr.RKey}}, time.Second)
	require.ErrorContains(t, err, "not in a registered memory region", "a local range outside registered memory is refused before posting")
}

func TestInjectedErrorCompletion(t *testing.T) {
	p := newPair(t, map[string]string{"MCG_NIC_FAIL_WR": "1"})
	src, dst, mr := p.buffers(t, 4096, 4096)
	err := p.qa.Writes(t.Context(), []Op{{Addr: src.addr(0), RemoteAddr: dst.addr(0), Len: 4096, RKey: mr.RKey}}, 5*time.Second)
	require.ErrorIs(t, err, ErrCompletion)
}

func TestFlushOutsideTheRegionCompletesInError(t *testing.T) {
	p := newPair(t, nil)
	require.True(t, p.a.Flush(), "the model's device does the FLUSH verb")
	const size = 4096
	dst := alloc(t, size)
	mr, err := p.b.Register(dst.addr(0), size)
	require.NoError(t, err)
	require.NoError(t, p.qa.Flushes(t.Context(), []Op{{RemoteAddr: dst.addr(0), Len: size, RKey: mr.RKey}}, 5*time.Second))
	err = p.qa.Flushes(t.Context(), []Op{{RemoteAddr: dst.addr(0), Len: size + 1, RKey: mr.RKey}}, 5*time.Second)
	require.ErrorIs(t, err, ErrCompletion, "a FLUSH past the region completes in error")
	require.Contains(t, err.Error(), "remote access error")
}

func TestNoFlushVerbMeansAPlainQP(t *testing.T) {
	p := newPair(t, map[string]string{"MCG_NIC_NO_FLUSH": "1"})
	require.False(t, p.a.Flush())
	require.False(t, p.qa.CanFlush())
	err := p.qa.Flushes(t.Context(), []Op{{RemoteAddr: 0x1000, Len: 1, RKey: 1}}, time.Second)
	require.ErrorContains(t, err, "cannot post FLUSH")
	// The plain QP still carries WRITEs and READs.
	src, dst, mr := p.buffers(t, 4096, 4096)
	require.NoError(t, p.qa.Writes(t.Context(), []Op{{Addr: src.addr(0), RemoteAddr: dst.addr(0), Len: 2048, RKey: mr.RKey}}, 5*time.Second))
	require.NoError(t, p.qa.Read(t.Context(), src.addr(2048), dst.addr(0), mr.RKey, 2048, 5*time.Second))
	require.Equal(t, src[:2048], src[2048:])
}
