package verify

import (
	"cmp"
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/core/config"
	"github.com/mcguard/mcguard/core/desc"
	"github.com/mcguard/mcguard/core/errs"
)

func envOf(m map[string]string) config.Getenv {
	return func(k string) (string, bool) { v, ok := m[k]; return v, ok }
}

func load(t *testing.T, env map[string]string, js string) (Config, error) {
	t.Helper()
	l, err := config.NewLoader(envOf(env), js)
	if err != nil {
		return Config{}, err
	}
	c := Load(l)
	return c, l.Err()
}

func TestConfigDefaults(t *testing.T) {
	c, err := load(t, nil, "")
	require.NoError(t, err)
	require.Equal(t, Defaults(), c)
	require.Equal(t, Tail, c.Mode)
	require.Equal(t, 64, c.TailBytes)
	require.Equal(t, 500, c.MaxRetries)
	require.Equal(t, time.Millisecond, c.RetrySleep)
}

func TestConfigPrecedence(t *testing.T) {
	env := map[string]string{
		"VLLM_MOONCAKE_TRANSFER_VERIFY":               "false",
		"VLLM_MOONCAKE_TRANSFER_VERIFY_TAIL_BYTES":    "128",
		"VLLM_MOONCAKE_TRANSFER_VERIFY_MAX_RETRIES":   "7",
		"VLLM_MOONCAKE_TRANSFER_VERIFY_RETRY_SLEEP_S": "0.002",
	}
	c, err := load(t, env, "")
	require.NoError(t, err)
	want := Defaults()
	want.Mode, want.TailBytes, want.MaxRetries, want.RetrySleep = Off, 128, 7, 2*time.Millisecond
	require.Equal(t, want, c)

	env["MC_GUARD_TAIL_BYTES"] = "256"
	env["MC_GUARD_VERIFY"] = "tail"
	c, err = load(t, env, "")
	require.NoError(t, err)
	require.Equal(t, 256, c.TailBytes, "MC_GUARD_* beats the vLLM name")
	require.Equal(t, Tail, c.Mode)

	c, err = load(t, env, `{"tail_bytes": 32, "verify": false, "retry_sleep_s": 0}`)
	require.NoError(t, err)
	require.Equal(t, 32, c.TailBytes, "JSON beats env")
	require.Equal(t, Off, c.Mode)
	require.Equal(t, time.Duration(0), c.RetrySleep)
}

func TestConfigRejectsBadValues(t *testing.T) {
	cases := []struct {
		name, js string
		env      map[string]string
		want     string
	}{
		{"tail zero", `{"tail_bytes": 0}`, nil, "tail_bytes"},
		{"tail text", "", map[string]string{"VLLM_MOONCAKE_TRANSFER_VERIFY_TAIL_BYTES": "lots"}, "VLLM_MOONCAKE_TRANSFER_VERIFY_TAIL_BYTES"},
		{"retries negative", `{"max_retries": -1}`, nil, "max_retries"},
		{"sleep negative", `{"retry_sleep_s": -0.5}`, nil, "retry_sleep_s"},
		{"sleep NaN", "", map[string]string{"MC_GUARD_RETRY_SLEEP_S": "NaN"}, "MC_GUARD_RETRY_SLEEP_S"},
		{"mode", `{"verify": "maybe"}`, nil, "verify"},
		{"unknown key", `{"tial_bytes": 3}`, nil, `unknown config key "tial_bytes"`},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := load(t, tc.env, tc.js)
			require.Error(t, err)
			require.ErrorIs(t, err, errs.Config)
			require.Contains(t, err.Error(), tc.want)
		})
	}
}

// fakeTarget is remote memory as a map of address to byte, with optional
// writes that become visible only after a number of reads (a lagging target).
// partlyArrived returns n patterned source bytes and a target holding
// those of them that arrived says landed.
func partlyArrived(n int, arrived func(i int) bool) ([]byte, *fakeTarget) {
	src := make([]byte, n)
	f := &fakeTarget{mem: map[uint64]byte{}, after: -1}
	for i := range src {
		src[i] = byte(i*13 + 5)
		if arrived(i) {
			f.mem[uint64(i)] = src[i]
		}
	}
	return src, f
}

type fakeTarget struct {
	mu    sync.Mutex
	mem   map[uint64]byte
	reads int
	late  []func()
	after int // reads before late writes land; <0: never
}

func (f *fakeTarget) read(_ context.Context, ranges []desc.Range, out []byte, _ func(uint64)) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.reads++
	if f.after >= 0 && f.reads > f.after {
		for _, w := range f.late {
			w()
		}
		f.late = nil
	}
	off := 0
	for _, r := range ranges {
		for i := uint64(0); i < r.Len; i++ {
			out[off] = f.mem[r.Addr+i]
			off++
		}
	}
	return nil
}

func localOf(src []byte) LocalFunc {
	return func(addr, n uint64) ([]byte, error) { return src[addr : addr+n], nil }
}

func TestCheckPassesWhenBytesArriveLate(t *testing.T) {
	src := []byte("0123456789abcdefghij")
	f := &fakeTarget{mem: map[uint64]byte{}, after: 3}
	f.late = append(f.late, func() {
		for i, b := range src {
			f.mem[1000+uint64(i)] = b
		}
	})
	cfg := Config{Mode: Tail, TailBytes: 4, MaxRetries: 10, RetrySleep: 0}
	res, err := Check(context.Background(), cfg, 0, []desc.Desc{{Src: 0, Dst: 1000, Len: 20}}, localOf(src), f.read, &Scratch{})
	require.NoError(t, err)
	require.Equal(t, 3, res.Retries)
	require.Equal(t, int64(4*4), res.Probed)
}

func TestCheckFailsAfterRetriesNamingDescriptors(t *testing.T) {
	src := make([]byte, 64)
	for i := range src {
		src[i] = byte(i + 1)
	}
	f := &fakeTarget{mem: map[uint64]byte{}, after: -1}
	for i := 0; i < 16; i++ { // descriptor 0 arrived; 1 and 2 never do
		f.mem[100+uint64(i)] = src[i]
	}
	descs := []desc.Desc{{Src: 0, Dst: 100, Len: 16}, {Src: 16, Dst: 200, Len: 16}, {Src: 32, Dst: 300, Len: 32}}
	cfg := Config{Mode: Tail, TailBytes: 8, MaxRetries: 5, RetrySleep: time.Microsecond}
	res, err := Check(context.Background(), cfg, 0, descs, localOf(src), f.read, &Scratch{})
	require.ErrorIs(t, err, ErrMismatch)
	var me *MismatchError
	require.True(t, errors.As(err, &me))
	require.Equal(t, []int{1, 2}, me.Descs)
	require.Equal(t, 5, me.Retries)
	require.Equal(t, 5, res.Retries)
	require.Equal(t, 6, f.reads, "one read, then max_retries more")
	require.Contains(t, err.Error(), "[1 2]")
}

func TestCheckOffReadsNothing(t *testing.T) {
	f := &fakeTarget{mem: map[uint64]byte{}, after: -1}
	cfg := Defaults()
	cfg.Mode = Off
	_, err := Check(context.Background(), cfg, 0, []desc.Desc{{Src: 0, Dst: 0, Len: 8}}, localOf(make([]byte, 8)), f.read, &Scratch{})
	require.NoError(t, err)
	require.Zero(t, f.reads)
}

func TestCheckShortDescriptorReadsWhole(t *testing.T) {
	src := []byte{1, 2, 3}
	f := &fakeTarget{mem: map[uint64]byte{10: 1, 11: 2, 12: 3}, after: -1}
	res, err := Check(context.Background(), Defaults(), 0, []desc.Desc{{Src: 0, Dst: 10, Len: 3}}, localOf(src), f.read, &Scratch{})
	require.NoError(t, err)
	require.Equal(t, int64(3), res.Probed)
}

func TestCheckHonoursContext(t *testing.T) {
	f := &fakeTarget{mem: map[uint64]byte{}, after: -1}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	cfg := Config{Mode: Tail, TailBytes: 1, MaxRetries: 1 << 20, RetrySleep: time.Millisecond}
	start := time.Now()
	_, err := Check(ctx, cfg, 0, []desc.Desc{{Src: 0, Dst: 0, Len: 1}}, localOf([]byte{9}), f.read, &Scratch{})
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.Less(t, time.Since(start), 2*time.Second)
}

func TestScratchGrows(t *testing.T) {
	var s Scratch
	require.Len(t, s.Bytes(10), 10)
	b := s.Bytes(1000)
	require.Len(t, b, 1000)
	require.Len(t, s.Bytes(5), 5)
	require.Equal(t, &b[0], &s.Bytes(5)[0], "scratch is reused, not reallocated")
}

func TestSampleSpans(t *testing.T) {
	cfg := Defaults()
	cfg.Mode = Sample
	n := uint64(1 << 20)
	a := spans(cfg, n, 1, nil)
	require.Len(t, a, 2+cfg.SampleStripes, "none overlaps another in 1 MiB with this seed")
	require.Equal(t, span{0, 64}, a[0], "head")
	require.Contains(t, a, span{n - 64, 64}, "tail")
	require.True(t, slices.IsSortedFunc(a, func(x, y span) int { return cmp.Compare(x.off, y.off) }),
		"in offset order, so that near ones can be read as one: %v", a)
	for _, s := range a {
		require.LessOrEqual(t, s.off+s.n, n, "stripes stay inside the descriptor")
	}
	b := spans(cfg, n, 2, nil)
	require.NotEqual(t, a, b, "another seed samples other bytes")
	require.Equal(t, a, spans(cfg, n, 1, nil), "the same seed samples the same bytes")
	require.Equal(t, []span{{0, 100}}, spans(cfg, 100, 1, nil), "a short descriptor is read whole")
}

// Sample's spans in a short descriptor overlap often: joined, each byte
// is read once, and every byte a span would have read still is.
func TestSampleSpansJoinWhereTheyOverlap(t *testing.T) {
	cfg := Defaults()
	cfg.Mode = Sample
	const n = 1024
	joined := 0
	for seed := uint64(1); seed <= 200; seed++ {
		a := spans(cfg, n, seed, nil)
		for i := 1; i < len(a); i++ {
			require.Greater(t, a[i].off, a[i-1].off+a[i-1].n, "apart and in order: %v", a)
		}
		covered := func(off uint64) bool {
			for _, s := range a {
				if off >= s.off && off < s.off+s.n {
					return true
				}
			}
			return false
		}
		// What the spans before joining read: head, tail and the stripes.
		r := splitmix{seed}
		want := []span{{0, 64}, {n - 64, 64}}
		for i := 0; i < cfg.SampleStripes; i++ {
			want = append(want, span{r.next() % (n - 64 + 1), 64})
		}
		for _, s := range want {
			for off := s.off; off < s.off+s.n; off++ {
				require.True(t, covered(off), "seed %d: byte %d of %v", seed, off, s)
			}
		}
		var read uint64
		for _, s := range a {
			read += s.n
		}
		require.LessOrEqual(t, read, uint64(len(want)*64))
		if len(a) < len(want) {
			joined++
		}
	}
	require.Greater(t, joined, 0, "some seeds' stripes overlap in 1 KiB")
}

func TestFullSpansCoverEveryByteInPieces(t *testing.T) {
	cfg := Defaults()
	cfg.Mode = Full
	sp := spans(cfg, 9<<20+5, 0, nil)
	var next uint64
	for _, s := range sp {
		require.Equal(t, next, s.off)
		require.LessOrEqual(t, s.n, uint64(maxProbe))
		next += s.n
	}
	require.Equal(t, uint64(9<<20+5), next)
}

func TestSampleCatchesAHoleThatTailMisses(t *testing.T) {
	src, f := partlyArrived(64<<10, func(i int) bool { return i >= 64<<10-4096 }) // only the last page arrived
	d := []desc.Desc{{Src: 0, Dst: 0, Len: uint64(len(src))}}
	cfg := Defaults()
	cfg.MaxRetries = 0
	_, err := Check(context.Background(), cfg, 0, d, localOf(src), f.read, &Scratch{})
	require.NoError(t, err, "tail sees only the page that arrived")
	cfg.Mode = Sample
	_, err = Check(context.Background(), cfg, 0, d, localOf(src), f.read, &Scratch{})
	require.ErrorIs(t, err, ErrMismatch, "sample reads the head too")
}

func TestSliceBytesChecksTheTailOfEverySlice(t *testing.T) {
	cfg := Defaults()
	cfg.SliceBytes = 64 << 10
	n := uint64(200 << 10) // three whole slices and a short last one
	want := []span{{64<<10 - 64, 64}, {128<<10 - 64, 64}, {192<<10 - 64, 64}, {n - 64, 64}}
	require.Equal(t, want, spans(cfg, n, 1, nil))
	require.Equal(t, []span{{100 - 64, 64}}, spans(cfg, 100, 1, nil), "a descriptor within one slice: its tail")
	cfg.SliceBytes = 0
	require.Equal(t, []span{{n - 64, 64}}, spans(cfg, n, 1, nil), "0: the descriptor's tail only")

	cfg.Mode, cfg.SliceBytes = Sample, 64<<10
	a := spans(cfg, n, 1, nil)
	require.Equal(t, span{0, 64}, a[0], "head")
	for _, s := range want {
		require.Contains(t, a, s, "every slice's tail")
	}
	require.Len(t, a, 5+cfg.SampleStripes)
}

func TestSliceBytesCatchesAMissingMiddleSlice(t *testing.T) {
	src, f := partlyArrived(256<<10, func(i int) bool { return i < 64<<10 || i >= 128<<10 }) // the second slice never arrived
	d := []desc.Desc{{Src: 0, Dst: 0, Len: uint64(len(src))}}
	cfg := Defaults()
	cfg.MaxRetries = 0
	_, err := Check(context.Background(), cfg, 0, d, localOf(src), f.read, &Scratch{})
	require.NoError(t, err, "the descriptor's tail arrived")
	cfg.SliceBytes = 64 << 10
	_, err = Check(context.Background(), cfg, 0, d, localOf(src), f.read, &Scratch{})
	require.ErrorIs(t, err, ErrMismatch, "the second slice's tail did not")
}

// A read that reports its bytes as they arrive has its probes compared
// meanwhile, in pieces that split probes anywhere, with the same verdict
// as a read that reports nothing; and a local failure met on the way
// fails the check.
func TestCheckComparesAsBytesArrive(t *testing.T) {
	const n, size = 64, 256
	src := make([]byte, n*size)
	for i := range src {
		src[i] = byte(i*7 + 3)
	}
	target := append([]byte(nil), src...)
	for _, bad := range []int{3, 17, 40} { // a byte in each of these descriptors' tails differs
		target[bad*size+size-1] ^= 0xff
	}
	descs := make([]desc.Desc, n)
	for i := range descs {
		descs[i] = desc.Desc{Src: uint64(i * size), Dst: uint64(i * size), Len: size}
	}
	cfg := Config{Mode: Sample, TailBytes: 16, SampleBytes: 16, SampleStripes: 4}
	var during int // probes compared while the read still ran
	reading := false
	compared := 0
	local := func(addr, k uint64) ([]byte, error) {
		compared++
		if reading {
			during++
		}
		return src[addr : addr+k], nil
	}
	read := func(piece uint64) ReadFunc {
		return func(_ context.Context, ranges []desc.Range, out []byte, arrived func(uint64)) error {
			reading = true
			defer func() { reading = false }()
			var off uint64
			for _, r := range ranges {
				copy(out[off:], target[r.Addr:r.Addr+r.Len])
				off += r.Len
			}
			for got := uint64(0); piece > 0 && got < off; {
				got = min(got+piece, off)
				arrived(got)
			}
			return nil
		}
	}
	var verdicts []string
	for _, piece := range []uint64{0, 1, 7, 100, 1 << 20} {
		during, compared = 0, 0
		_, err := Check(context.Background(), cfg, 42, descs, local, read(piece), &Scratch{})
		var me *MismatchError
		require.ErrorAs(t, err, &me, "piece %d", piece)
		require.Equal(t, []int{3, 17, 40}, me.Descs, "piece %d", piece)
		verdicts = append(verdicts, err.Error())
		if piece > 0 && piece < 1<<20 {
			require.Positive(t, during, "piece %d: probes compared as their bytes came", piece)
		}
	}
	for _, v := range verdicts[1:] {
		require.Equal(t, verdicts[0], v)
	}

	failing := func(addr, k uint64) ([]byte, error) {
		if addr >= 20*size {
			return nil, errors.New("source unregistered")
		}
		return src[addr : addr+k], nil
	}
	_, err := Check(context.Background(), cfg, 42, descs, failing, read(7), &Scratch{})
	require.ErrorContains(t, err, "source unregistered")
}
