package core

import (
	"bytes"
	"crypto/rand"
	"crypto/sha256"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/core/desc"
	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/core/transport/tcp"
	"github.com/mcguard/mcguard/verify"
)

// readerPair is a pair whose receiver produces (seals its destination
// blocks) and whose sender reads them into its source blocks, over plane.
func readerPair(t *testing.T, plane string, size int) *pair {
	switch plane {
	case "same-host":
		return newPair(t, `{"same_host": "required"}`, "", size)
	case "same-host-mapped":
		return newMappedPair(t, `{"same_host": "required"}`, "", size)
	case "rdma":
		key := rdmaKey(t)
		return newPair(t, "{"+key+"}", "{"+key+"}", size)
	case "engine":
		return newEnginePair(t, "", "", size, newFakeEngines())
	}
	return newPair(t, `{"same_host": "off"}`, "", size)
}

// sealBlocks has p's receiver seal the destinations of descs.
func sealBlocks(t *testing.T, p *pair, descs []desc.Desc) []byte {
	t.Helper()
	ranges := make([]desc.Range, len(descs))
	for i, d := range descs {
		ranges[i] = desc.Range{Addr: d.Dst, Len: d.Len}
	}
	s, err := p.recv.Seal(ranges)
	require.NoError(t, err)
	return s
}

var sealPlanes = []string{"socket", "same-host", "same-host-mapped", "rdma", "engine"}

// A sealed read succeeds with the producer's bytes on every data plane,
// in both modes, and fails, naming the range, once the producer reused a
// block after sealing it.
func TestSealedReadOnEveryDataPlane(t *testing.T) {
	const n, size = 16, 16 << 10
	for _, plane := range sealPlanes {
		for _, mode := range SealModes {
			t.Run(plane+"/"+string(mode), func(t *testing.T) {
				p := readerPair(t, plane, n*size)
				descs := p.blocks(n, size)
				rand.Read(p.dst.b)
				sealed := sealBlocks(t, p, descs)
				clear(p.src.b)
				require.NoError(t, p.send.ReadSealed(p.session, descs, sealed, mode))
				require.Equal(t, sha256.Sum256(p.dst.b), sha256.Sum256(p.src.b), "the reader holds the producer's bytes")

				rand.Read(p.dst.b[5*size+size-64 : 6*size]) // block 5 reused: its tail changes
				err := p.send.ReadSealed(p.session, descs, sealed, mode)
				require.ErrorIs(t, err, errs.Verify)
				require.Contains(t, err.Error(), "[5]")
				require.Equal(t, 1.0, stats(t, p.send)["seals_checked"])
			})
		}
	}
}

// A producer rewriting its blocks while readers read them never lets a
// digest-checked read succeed with bytes other than the sealed ones.
func TestSealedReadNeverSucceedsWithReusedBytes(t *testing.T) {
	const n, size = 32, 64 << 10
	for _, plane := range []string{"socket", "same-host"} {
		t.Run(plane, func(t *testing.T) {
			p := readerPair(t, plane, n*size)
			descs := p.blocks(n, size)
			rand.Read(p.dst.b)
			sealed := sealBlocks(t, p, descs)
			want := sha256.Sum256(p.dst.b)
			var stop atomic.Bool
			var wg sync.WaitGroup
			wg.Add(1)
			go func() { // the producer reuses block after block
				defer wg.Done()
				junk := make([]byte, 512)
				for i := 0; !stop.Load(); i++ {
					rand.Read(junk)
					off := (i % n) * size
					copy(p.dst.b[off+(i*997)%(size-512):], junk)
				}
			}()
			var ok, failed int
			for range 40 {
				clear(p.src.b)
				err := p.send.ReadSealed(p.session, descs, sealed, verify.Digest)
				if err != nil {
					require.ErrorIs(t, err, errs.Verify)
					failed++
					continue
				}
				ok++
				require.Equal(t, want, sha256.Sum256(p.src.b), "a read that succeeded holds the sealed bytes")
			}
			stop.Store(true)
			wg.Wait()
			require.Positive(t, failed, "reads of blocks being rewritten failed")
			t.Logf("%s: %d reads failed, %d succeeded with the sealed bytes", plane, failed, ok)
		})
	}
}

// A read that lands only part of a range (an engine that drops a slice
// and says done) fails the digest check, and the tail check where the
// lost slice is the range's last.
func TestSealedReadCatchesAPartialRead(t *testing.T) {
	const n, size = 4, 256 << 10
	f := newFakeEngines()
	p := newEnginePair(t, "", "", n*size, f)
	descs := p.blocks(n, size)
	for _, c := range []struct {
		lost uint64
		mode verify.Mode
		ok   bool
	}{{64 << 10, verify.Digest, false}, {192 << 10, verify.Digest, false}, {192 << 10, verify.Tail, false}, {64 << 10, verify.Tail, true}} {
		rand.Read(p.dst.b) // new bytes each time: what a lost slice leaves behind is stale
		sealed := sealBlocks(t, p, descs)
		clear(p.src.b)
		f.loseRead = func(off uint64) bool { return off == c.lost }
		err := p.send.ReadSealed(p.session, descs, sealed, c.mode)
		if c.ok { // tail mode proves each range's end, not its middle
			require.NoError(t, err)
			require.NotEqual(t, p.dst.b, p.src.b)
			continue
		}
		require.ErrorIs(t, err, errs.Verify, "slice at %d lost, %s check", c.lost, c.mode)
	}
	f.loseRead = nil
	require.NoError(t, p.send.ReadSealed(p.session, descs, sealBlocks(t, p, descs), verify.Digest))
	require.True(t, bytes.Equal(p.dst.b, p.src.b))
}

// A seal that is not for the ranges read, truncated, forged, unsigned
// where the guards share a secret, or from another producer is refused
// with errs.Seal before or after the read, never a success.
func TestBadSealsAreRefused(t *testing.T) {
	const n, size = 4, 4096
	secret := `"secret": "correct horse battery staple"`
	p := newPair(t, "{"+secret+`, "same_host": "off"}`, "{"+secret+"}", n*size)
	other := openGuard(t, "{"+secret+"}")
	unsigned := openGuard(t, "")
	descs := p.blocks(n, size)
	rand.Read(p.dst.b)
	sealed := sealBlocks(t, p, descs)
	require.NoError(t, p.send.ReadSealed(p.session, descs, sealed, verify.Digest))

	ranges := make([]desc.Range, n)
	for i, d := range descs {
		ranges[i] = desc.Range{Addr: d.Dst, Len: d.Len}
	}
	// Another guard with the same secret seals the very same memory: same
	// addresses, lengths and bytes; only the producer differs.
	require.NoError(t, other.Register(p.dst.addr(0), n*size))
	fromOther, err := other.Seal(ranges)
	require.NoError(t, err)
	unsignedMem := newMem(t, size)
	require.NoError(t, unsigned.Register(unsignedMem.addr(0), size))
	unsignedSeal, err := unsigned.Seal([]desc.Range{{Addr: unsignedMem.addr(0), Len: size}})
	require.NoError(t, err)

	otherDescs := append([]desc.Desc(nil), descs...)
	for i := range otherDescs {
		otherDescs[i].Dst = 0 // remote addresses the caller does not name
	}
	forged := append([]byte(nil), sealed...)
	forged[40+16] ^= 1 // range 0's digest
	shorter := append([]desc.Desc(nil), descs...)
	shorter[2].Len--
	moved := append([]desc.Desc(nil), descs...)
	moved[1].Dst += 64
	for name, c := range map[string]struct {
		seal  []byte
		descs []desc.Desc
	}{
		"truncated":        {sealed[:len(sealed)-1], descs},
		"garbage":          {[]byte("not a seal at all, just some bytes that are long enough"), descs},
		"empty":            {nil, descs},
		"fewer, unnamed":   {sealed, otherDescs[:n-1]},
		"another length":   {sealed, shorter},
		"another address":  {sealed, moved},
		"forged":           {forged, descs},
		"unsigned":         {unsignedSeal, descs[:1]},
		"another producer": {fromOther, descs},
	} {
		clear(p.src.b)
		err := p.send.ReadSealed(p.session, c.descs, c.seal, verify.Digest)
		require.ErrorIs(t, err, errs.Seal, name)
		if name != "fewer, unnamed" { // not a read: nothing to take the ranges from
			err = p.send.CheckSeal(c.seal, c.descs, verify.Digest, p.recv.id[:])
			require.ErrorIs(t, err, errs.Seal, name)
		}
	}
	require.ErrorIs(t, p.send.ReadSealed(p.session, descs, sealed, verify.Sample), errs.InvalidArg)
	_, err = p.recv.Seal(nil)
	require.ErrorIs(t, err, errs.InvalidArg)
	_, err = p.recv.Seal([]desc.Range{{Addr: p.src.addr(0), Len: size}})
	require.ErrorIs(t, err, errs.NotRegistered)
	_, err = p.recv.Seal([]desc.Range{{Addr: p.dst.addr(0), Len: 0}})
	require.ErrorIs(t, err, errs.InvalidArg)
}

// CheckSeal verifies a read that another engine made: the landed bytes
// against the seal, with or without the remote addresses.
func TestCheckSealAfterAnotherEnginesRead(t *testing.T) {
	const n, size = 8, 8192
	p := newPair(t, "", "", n*size)
	descs := p.blocks(n, size)
	rand.Read(p.dst.b)
	sealed := sealBlocks(t, p, descs)
	copy(p.src.b, p.dst.b) // the other engine's read
	id := p.recv.ID()
	require.NoError(t, p.send.CheckSeal(sealed, descs, verify.Digest, id[:]))
	anon := append([]desc.Desc(nil), descs...)
	for i := range anon {
		anon[i].Dst = 0
	}
	require.NoError(t, p.send.CheckSeal(sealed, anon, verify.Tail, nil))
	p.src.b[3*size] ^= 1
	err := p.send.CheckSeal(sealed, descs, verify.Digest, nil)
	require.ErrorIs(t, err, errs.Verify)
	require.Contains(t, err.Error(), "[3]")
}

// A producer that quiesces its sealed blocks before reusing them (its
// request timed out, say) waits for a read of them the target is
// answering, which then holds the sealed bytes, and refuses a read sent
// before the quiesce that reaches the target after it (errs.Quiesced):
// neither has to be caught by the reader's check.
func TestProducerQuiesceWaitsForOrRefusesReadsInFlight(t *testing.T) {
	const n, size = 16, 64 << 10
	for _, phase := range []string{"reading", "arrived"} {
		t.Run(phase, func(t *testing.T) {
			p := readerPair(t, "socket", n*size)
			descs := p.blocks(n, size)
			ranges := make([]SyncRange, n)
			for i, d := range descs {
				ranges[i] = SyncRange{Addr: d.Dst, Len: d.Len}
			}
			rand.Read(p.dst.b)
			sealed := sealBlocks(t, p, descs)
			require.NoError(t, p.send.ReadSealed(p.session, descs, sealed, verify.Digest)) // connected
			want := sha256.Sum256(p.dst.b)
			held, release := make(chan struct{}), make(chan struct{})
			var once sync.Once
			p.recv.plane(tcp.Name).(*tcp.Transport).HoldReadsForTest(func(at string) {
				if at == phase {
					once.Do(func() { close(held); <-release })
				}
			})
			clear(p.src.b)
			read := make(chan error, 1)
			go func() { read <- p.send.ReadSealed(p.session, descs, sealed, verify.Digest) }()
			<-held
			quiesced := make(chan error, 1)
			go func() { quiesced <- p.recv.Quiesce(ranges) }()
			if phase == "reading" {
				select {
				case <-quiesced:
					t.Fatal("the quiesce returned while a read of its ranges was being answered")
				case <-time.After(100 * time.Millisecond):
				}
				close(release)
				require.NoError(t, <-quiesced)
				rand.Read(p.dst.b) // reused the moment the quiesce returned
				require.NoError(t, <-read)
				require.Equal(t, want, sha256.Sum256(p.src.b))
				return
			}
			require.NoError(t, <-quiesced)
			rand.Read(p.dst.b)
			close(release)
			require.ErrorIs(t, <-read, errs.Quiesced)
			// A read sent after the quiesce is taken, and its check fails:
			// the producer's bytes are not the sealed ones any more.
			require.ErrorIs(t, p.send.ReadSealed(p.session, descs, sealed, verify.Digest), errs.Verify)
		})
	}
}

// A reader fetches the seal a producer published under a request's name,
// waiting for it where the producer has not published it yet; a withdrawn
// or unknown name times out; over an engine the peer's guard is asked.
func TestPublishedSealsAreFetchedByName(t *testing.T) {
	const n, size = 8, 8192
	for _, plane := range []string{"socket", "engine"} {
		t.Run(plane, func(t *testing.T) {
			p := readerPair(t, plane, n*size)
			descs := p.blocks(n, size)
			ranges := make([]desc.Range, n)
			for i, d := range descs {
				ranges[i] = desc.Range{Addr: d.Dst, Len: d.Len}
			}
			rand.Read(p.dst.b)
			go func() {
				time.Sleep(50 * time.Millisecond)
				p.recv.Publish("req-1", ranges)
			}()
			sealed, err := p.send.FetchSeal(p.session, "req-1", 5*time.Second)
			require.NoError(t, err)
			require.NoError(t, p.send.ReadSealed(p.session, descs, sealed, verify.Digest))
			require.Equal(t, sha256.Sum256(p.dst.b), sha256.Sum256(p.src.b))
			require.Equal(t, 1.0, stats(t, p.recv)["seals_published"])

			require.NoError(t, p.recv.Withdraw("req-1"))
			for _, wait := range []time.Duration{100 * time.Millisecond, time.Millisecond, 0} {
				_, err = p.send.FetchSeal(p.session, "req-1", wait)
				require.ErrorIs(t, err, errs.Timeout)
				require.Contains(t, err.Error(), "published no seal", "the peer answered: it is the wait that ended, however short")
			}
			require.ErrorIs(t, p.recv.Withdraw("req-1"), errs.InvalidArg)
			_, err = p.send.FetchSeal(p.session, "", time.Second)
			require.ErrorIs(t, err, errs.InvalidArg)
			require.ErrorIs(t, p.recv.Publish("", ranges), errs.InvalidArg)
		})
	}
	f := newFakeEngines()
	g, err := OpenWithEngine(testConfig(t, ""), f.ops("prefill", "fake"))
	require.NoError(t, err)
	defer g.Close()
	_, err = g.FetchSeal("decode:1", "req-1", time.Second)
	require.ErrorIs(t, err, errs.Config, "over an engine without the peer's guard named")
}

// A request's sealed blocks read over several reads, some of them in
// another order (as a connector splits them by region), are each checked
// against their own sealed range by address.
func TestSealedRangesReadInPartsAreMatchedByAddress(t *testing.T) {
	const n, size = 8, 8192
	p := readerPair(t, "socket", n*size)
	descs := p.blocks(n, size)
	rand.Read(p.dst.b)
	sealed := sealBlocks(t, p, descs)
	first, second := []desc.Desc{descs[5], descs[1], descs[3]}, []desc.Desc{descs[0], descs[2], descs[4], descs[6], descs[7]}
	require.NoError(t, p.send.ReadSealed(p.session, first, sealed, verify.Digest))
	require.NoError(t, p.send.ReadSealed(p.session, second, sealed, verify.Tail))
	require.Equal(t, sha256.Sum256(p.dst.b), sha256.Sum256(p.src.b))
	p.dst.b[3*size+size-1] ^= 1 // block 3 reused: the first read's range 2
	err := p.send.ReadSealed(p.session, first, sealed, verify.Tail)
	require.ErrorIs(t, err, errs.Verify)
	require.Contains(t, err.Error(), "[2]")
	half := descs[4]
	half.Len /= 2
	require.ErrorIs(t, p.send.ReadSealed(p.session, []desc.Desc{half}, sealed, verify.Digest), errs.Seal, "part of a sealed range")
}
