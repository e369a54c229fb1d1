package verify

import (
	"bytes"
	"cmp"
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/mcguard/mcguard/core/desc"
	"github.com/mcguard/mcguard/core/errs"
)

// ReadFunc reads the remote ranges, concatenated in order, into out in one
// round trip; len(out) is the sum of the ranges' lengths. It may call
// arrived as the bytes come in, with how many of out's leading bytes are
// in place, so that Check compares those while the rest are on their way.
type ReadFunc func(ctx context.Context, ranges []desc.Range, out []byte, arrived func(n uint64)) error

// LocalFunc returns the local source bytes [addr, addr+n), already checked
// to lie in registered memory (a copy, for device memory).
type LocalFunc func(addr, n uint64) ([]byte, error)

// Scratch is the read-back buffer of one session. A session owns its own,
// so two sessions verifying at once never share bytes.
type Scratch struct {
	buf    []byte
	probes []probe // Check's plan, and the lists it builds it with
	spans  []span
	ranges []desc.Range
	cmp    comparer
	// arrived is cmp.arrived, bound once (a method value made per read
	// would allocate)
	arrived func(n uint64)
}

// comparer compares a window's probes with their sources as the window's
// bytes arrive (ReadFunc's arrived), in order.
type comparer struct {
	window []probe
	buf    []byte
	local  LocalFunc
	next   int     // window[next] is the first probe not compared yet
	off    uint64  // where its bytes start in buf
	still  []probe // the probes that differed, appended
	err    error   // local's: comparing stops
}

func (c *comparer) arrived(n uint64) {
	for c.err == nil && c.next < len(c.window) {
		p := c.window[c.next]
		if c.off+p.n > n {
			return
		}
		want, err := c.local(p.src, p.n)
		if err != nil {
			c.err = err
			return
		}
		if !bytes.Equal(c.buf[c.off:c.off+p.n], want) {
			c.still = append(c.still, p)
		}
		c.off += p.n
		c.next++
	}
}

// planned is how many probes the last Check planned: a read of that many
// ranges is the whole first round, in one window.
func (s *Scratch) planned() int { return len(s.probes) }

// Bytes returns n bytes of scratch, growing it when needed.
func (s *Scratch) Bytes(n uint64) []byte {
	if uint64(cap(s.buf)) < n {
		s.buf = make([]byte, n)
	}
	return s.buf[:n]
}

// ErrMismatch marks a verification that ran out of retries.
var ErrMismatch = errs.Verify

// MismatchError names the descriptors whose bytes never matched.
type MismatchError struct {
	Descs   []int // indices into the batch, ascending
	Retries int
	Where   string // what was checked, for the message ("at the target", ...)
}

func (e *MismatchError) Error() string {
	shown := e.Descs
	more := ""
	if len(shown) > 16 {
		shown, more = shown[:16], fmt.Sprintf(" and %d more", len(e.Descs)-16)
	}
	parts := make([]string, len(shown))
	for i, d := range shown {
		parts[i] = fmt.Sprint(d)
	}
	where := e.Where
	if where == "" {
		where = fmt.Sprintf("still differ at the target after %d retries", e.Retries)
	}
	return fmt.Sprintf("%v: %d descriptor(s) %s: [%s]%s",
		ErrMismatch, len(e.Descs), where, strings.Join(parts, " "), more)
}

func (e *MismatchError) Unwrap() error { return ErrMismatch }

// probe is one range of one descriptor that is read back and compared.
type probe struct {
	desc     int    // index in the batch
	src, dst uint64 // absolute addresses
	n        uint64
}

// span is a range of a descriptor, by offset.
type span struct{ off, n uint64 }

// spans lists the ranges of a descriptor of length n that mode reads back.
// seed varies the sample's stripes per transfer and per descriptor.
func spans(cfg Config, n, seed uint64, out []span) []span {
	switch cfg.Mode {
	case Tail:
		return sliceTails(cfg, n, out)
	case Full:
		for off := uint64(0); off < n; off += maxProbe {
			out = append(out, span{off, min(maxProbe, n-off)})
		}
		return out
	case Sample:
		head, tail := min(uint64(cfg.SampleBytes), n), min(uint64(cfg.TailBytes), n)
		stripe := uint64(cfg.SampleBytes)
		if head+tail+uint64(cfg.SampleStripes)*stripe >= n {
			return append(out, span{0, n}) // as cheap as sampling: read it all
		}
		if cfg.SliceBytes > 0 && n > uint64(cfg.SliceBytes) {
			tail = uint64(cfg.TailBytes) * ((n + uint64(cfg.SliceBytes) - 1) / uint64(cfg.SliceBytes))
			if head+tail+uint64(cfg.SampleStripes)*stripe >= n {
				return append(out, span{0, n})
			}
		}
		first := len(out)
		out = sliceTails(cfg, n, append(out, span{0, head}))
		r := splitmix{seed}
		for i := 0; i < cfg.SampleStripes; i++ {
			out = append(out, span{r.next() % (n - stripe + 1), stripe})
		}
		// In offset order, overlapping ones joined: a reader on the same
		// host reads spans near one another as one (a kernel copy costs
		// mostly per range), which overlapping ones would keep apart.
		slices.SortStableFunc(out[first:], func(a, b span) int { return cmp.Compare(a.off, b.off) })
		k := first
		for _, sp := range out[first+1:] {
			if last := &out[k]; sp.off <= last.off+last.n {
				last.n = max(last.n, sp.off+sp.n-last.off)
				continue
			}
			k++
			out[k] = sp
		}
		return out[:k+1]
	}
	return out
}

// sliceTails appends the tail of a descriptor of length n: its last
// TailBytes, or with SliceBytes the last TailBytes of every slice.
func sliceTails(cfg Config, n uint64, out []span) []span {
	slice := n
	if cfg.SliceBytes > 0 {
		slice = uint64(cfg.SliceBytes)
	}
	for start := uint64(0); start < n; start += slice {
		end := min(start+slice, n)
		k := min(uint64(cfg.TailBytes), end-start)
		out = append(out, span{end - k, k})
	}
	return out
}

// splitmix is SplitMix64: a tiny, well-mixed generator for stripe offsets.
type splitmix struct{ s uint64 }

func (r *splitmix) next() uint64 {
	r.s += 0x9e3779b97f4a7c15
	z := r.s
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	return z ^ (z >> 31)
}

// probes lists what cfg reads back for descs, in the scratch's lists (so
// a session's transfers reuse them).
func probes(cfg Config, seed uint64, descs []desc.Desc, scratch *Scratch) []probe {
	if !cfg.Mode.ReadsBack() {
		return nil
	}
	out, sp := scratch.probes[:0], scratch.spans[:0]
	for i, d := range descs {
		sp = spans(cfg, d.Len, seed^uint64(i+1)*0x2545f4914f6cdd1d, sp[:0])
		for _, s := range sp {
			out = append(out, probe{desc: i, src: d.Src + s.off, dst: d.Dst + s.off, n: s.n})
		}
	}
	scratch.probes, scratch.spans = out, sp
	return out
}

// maxWindow bounds the bytes read back in one request, and so the scratch;
// maxProbe bounds one range (full mode cuts descriptors into such pieces).
const (
	maxWindow = 64 << 20
	maxProbe  = 4 << 20
)

// Result reports what a Check did.
type Result struct {
	Retries int   // polling rounds after the first read
	Probed  int64 // bytes read back in all rounds
}

// Check confirms descs at the target: it reads back what cfg asks for,
// one request per round (per 64 MiB for full), and polls with
// cfg.RetrySleep between rounds until every probe equals its source or
// cfg.MaxRetries rounds have passed. seed varies the sample per transfer.
// A MismatchError names indices into descs.
func Check(ctx context.Context, cfg Config, seed uint64, descs []desc.Desc, local LocalFunc, remote ReadFunc, scratch *Scratch) (Result, error) {
	pending := probes(cfg, seed, descs, scratch)
	var res Result
	ranges := scratch.ranges[:0]
	defer func() { scratch.ranges = ranges }()
	for round := 0; ; round++ {
		still := pending[:0]
		for start := 0; start < len(pending); {
			// One window: as many probes as fit in maxWindow (at least one).
			end, total := start, uint64(0)
			for end < len(pending) && (end == start || total+pending[end].n <= maxWindow) {
				total += pending[end].n
				end++
			}
			ranges = ranges[:0]
			for _, p := range pending[start:end] {
				ranges = append(ranges, desc.Range{Addr: p.dst, Len: p.n})
			}
			buf := scratch.Bytes(total)
			// still shares pending's array: the comparer appends at most
			// one probe per probe it has read, so it never overtakes them.
			c := &scratch.cmp
			*c = comparer{window: pending[start:end], buf: buf, local: local, still: still}
			if scratch.arrived == nil {
				scratch.arrived = c.arrived
			}
			err := remote(ctx, ranges, buf, scratch.arrived)
			if err == nil {
				c.arrived(total) // what the read did not report
				err = c.err
			}
			still = c.still
			*c = comparer{} // keep no reference to the caller's memory
			if err != nil {
				return res, err
			}
			res.Probed += int64(total)
			start = end
		}
		pending = still
		if len(pending) == 0 {
			return res, nil
		}
		if round >= cfg.MaxRetries {
			return res, mismatch(pending, res.Retries)
		}
		res.Retries++
		if err := sleep(ctx, cfg.RetrySleep); err != nil {
			return res, err
		}
	}
}

func mismatch(pending []probe, retries int) error {
	e := &MismatchError{Retries: retries}
	for _, p := range pending {
		if len(e.Descs) == 0 || e.Descs[len(e.Descs)-1] != p.desc {
			e.Descs = append(e.Descs, p.desc)
		}
	}
	return e
}

func sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
