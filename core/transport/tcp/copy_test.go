package tcp

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"io"
	"os/exec"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/mcguard/mcguard/core/desc"
	"github.com/mcguard/mcguard/core/internal/testmem"
	"github.com/mcguard/mcguard/core/memory"
	"github.com/mcguard/mcguard/core/transport/samehost"
)

// A copy into a receiver's mapped allocation, or out of it, counts only
// where the receiving process was still there when it ended: its pages
// outlive it in the sender's mapping.
func TestMappedCopiesFailOnceTheReceiverIsGone(t *testing.T) {
	l, p, err := samehost.NewLeasePairForTest(time.Second)
	require.NoError(t, err)
	defer l.Close()
	defer p.Close()
	f, err := samehost.AllocShared(4096, "receiver")
	require.NoError(t, err)
	defer f.Free()
	l.Add(f.Addr, f.Len, *f)
	src := testmem.Map(t, 4096) // as the library's callers' memory: not Go's heap
	rand.Read(src)
	local := memory.New(nil)
	require.NoError(t, local.Add(uint64(uintptr(unsafe.Pointer(&src[0]))), 4096))
	c := &conn{local: local, lease: p}
	descs := []desc.Desc{{Src: uint64(uintptr(unsafe.Pointer(&src[0]))), Dst: f.Addr, Len: 4096}}
	done, err := c.push(context.Background(), descs)
	require.NoError(t, err)
	require.True(t, done)
	require.Equal(t, src, memory.BytesAt(f.Addr, 4096), "by memcpy into the mapping")
	out := make([]byte, 4096)
	done, err = c.pullRanges([]desc.Range{{Addr: f.Addr, Len: 4096}}, out)
	require.NoError(t, err)
	require.True(t, done)
	require.Equal(t, src, out)

	// The receiver's pidfd now names a process that has exited.
	child := exec.Command("true")
	require.NoError(t, child.Start())
	gone, err := unix.PidfdOpen(child.Process.Pid, 0)
	require.NoError(t, err)
	require.NoError(t, child.Wait())
	p.WatchTargetForTest(gone)
	_, err = c.push(context.Background(), descs)
	require.ErrorContains(t, err, "has exited")
	_, err = c.pullRanges([]desc.Range{{Addr: f.Addr, Len: 4096}}, out)
	require.ErrorContains(t, err, "has exited")
}

// A write's payload comes out of the connection's buffer as far as the
// buffer holds it, and the rest straight from the connection where it is
// large: every byte in order, the frames after it still in step, and
// the large rest read into place, not through the buffer.
func TestStreamSourceReadsLargeRestsPastTheBuffer(t *testing.T) {
	for _, size := range []int{100, 20 << 10, 200 << 10, 600 << 10} {
		stream := make([]byte, 2*size+8)
		rand.Read(stream)
		raw := &placeReader{r: bytes.NewReader(stream)}
		r := bufio.NewReaderSize(raw, readBuffer)
		_, err := r.Peek(8) // a header's read fills the buffer
		require.NoError(t, err)
		r.Discard(8)
		for i := range 2 {
			m := make([]byte, size)
			raw.place, raw.placed = m, 0
			buffered := r.Buffered()
			require.NoError(t, streamSource{r: r, raw: raw, n: uint64(size)}.fill(m))
			require.Equal(t, stream[8+i*size:8+(i+1)*size], m, "size %d write %d", size, i)
			if rest := size - buffered; rest >= directMin {
				require.Equal(t, rest, raw.placed, "size %d write %d: the rest read into place", size, i)
			} else {
				require.Zero(t, raw.placed, "size %d write %d: a small rest comes through the buffer", size, i)
			}
		}
	}
}

// placeReader counts the bytes read straight into place; it gives at
// most 32 KiB a read, as a socket gives what has come.
type placeReader struct {
	r      io.Reader
	place  []byte
	placed int
}

func (p *placeReader) Read(b []byte) (int, error) {
	k, err := p.r.Read(b[:min(len(b), 32<<10)])
	if len(b) > 0 && len(p.place) > 0 {
		at := uintptr(unsafe.Pointer(&b[0]))
		start := uintptr(unsafe.Pointer(&p.place[0]))
		if at >= start && at < start+uintptr(len(p.place)) {
			p.placed += k
		}
	}
	return k, err
}

// A same-host read-back reads ranges a little apart in one registered
// region as one span, the bytes between thrown away, and never reads
// across two regions: between them may be memory the receiver never
// registered (here a page that cannot be read, which would fail it).
func TestPullReadsSpansWithinARegionOnly(t *testing.T) {
	l, p, err := samehost.NewLeasePairForTest(time.Second)
	require.NoError(t, err)
	defer l.Close()
	defer p.Close()
	m := testmem.Map(t, 3*4096)
	rand.Read(m)
	base := uint64(uintptr(unsafe.Pointer(&m[0])))
	require.NoError(t, unix.Mprotect(m[4096:2*4096], unix.PROT_NONE))
	t.Cleanup(func() { unix.Mprotect(m[4096:2*4096], unix.PROT_READ|unix.PROT_WRITE) })
	var none samehost.SharedFile
	l.Add(base, 4096, none)
	l.Add(base+2*4096, 4096, none)
	c := &conn{lease: p}
	pull := func(ranges ...desc.Range) []byte {
		t.Helper()
		var n uint64
		for _, r := range ranges {
			n += r.Len
		}
		out := make([]byte, n)
		done, err := c.pullRanges(ranges, out)
		require.NoError(t, err)
		require.True(t, done)
		return out
	}
	// Head, a stripe and the tail of the first page: one span.
	got := pull(desc.Range{Addr: base, Len: 64}, desc.Range{Addr: base + 1000, Len: 64}, desc.Range{Addr: base + 4032, Len: 64})
	require.Equal(t, append(append(append([]byte(nil), m[:64]...), m[1000:1064]...), m[4032:4096]...), got)
	require.Len(t, c.iovRemote, 1, "one span")
	// The first page's tail and the third page's head, 4 KiB apart: two.
	got = pull(desc.Range{Addr: base + 4032, Len: 64}, desc.Range{Addr: base + 2*4096, Len: 64})
	require.Equal(t, append(append([]byte(nil), m[4032:4096]...), m[2*4096:2*4096+64]...), got)
	require.Len(t, c.iovRemote, 2, "a span each side of the unregistered page")
	// Out of order, or overlapping: a span each.
	got = pull(desc.Range{Addr: base + 100, Len: 64}, desc.Range{Addr: base + 120, Len: 8}, desc.Range{Addr: base, Len: 4})
	require.Equal(t, append(append(append([]byte(nil), m[100:164]...), m[120:128]...), m[:4]...), got)
	require.Len(t, c.iovRemote, 3)
}
