package tcp

import (
	"context"

	"github.com/mcguard/mcguard/core/desc"
	"github.com/mcguard/mcguard/core/logs"
	"github.com/mcguard/mcguard/core/memory"
	"github.com/mcguard/mcguard/core/transport"
)

// Striping (tcp_stripes): a session may use several data connections to
// one target, as UCX's lanes and Mooncake's connections do, so that one
// session is not bound by one socket (one core copying on each side).
//
//   - The first connection opens with the session; the others at its
//     first batch of at least stripeMin bytes, so sessions that never move
//     one (and the latency path) cost one connection. Where the first
//     connection writes into the receiver itself (same host) none opens:
//     that copy is split over threads instead.
//   - A large batch is cut into one contiguous run per connection of about
//     equal bytes, each sent by a goroutine of its own. A cut inside a
//     descriptor falls on its MaxSlice grid, where its frames are cut
//     anyway (a single 64 MiB descriptor goes over every connection, in the
//     frames it would take on one). Digest mode's marked writes, which the
//     target digests per descriptor as they land, are cut between
//     descriptors.
//   - A smaller batch goes on the first connection alone, on the caller's
//     goroutine, so the latency path is unchanged.
//   - Each connection is fenced on its own; read-backs and completion
//     notices go on the first once the others' fences have answered.

// MaxStripes bounds tcp_stripes.
const MaxStripes = 8

// stripeMin is the smallest batch that is striped.
const stripeMin = 1 << 20

type striped struct {
	caps    transport.Caps
	parts   []*conn // open, the first from the start
	want    int     // tcp_stripes
	dial    func(ctx context.Context, i int) (*conn, error)
	dialErr error // why the others could not be opened: not tried again on this session's connection

	written []bool        // per part, since its last fence
	runs    []stripeRun   // per part, the batch being sent
	cut     [][]desc.Desc // per part, its run's descriptors where a descriptor was cut (reused)
	bounds  []uint64      // the batch offsets the parts' runs start at, and its end (reused)
}

// stripeRun is one part's share of a batch: its descriptors and the
// batch index of the first.
type stripeRun struct {
	descs []desc.Desc
	base  int
}

func newStriped(first *conn, want int, dial func(ctx context.Context, i int) (*conn, error)) *striped {
	s := &striped{parts: []*conn{first}, want: want, dial: dial,
		written: make([]bool, want), runs: make([]stripeRun, want), cut: make([][]desc.Desc, want)}
	// Reads go to the first part alone, whole: no streaming or pipelining.
	s.caps = transport.Caps{Post: s, PostMarked: s, Notices: s, Transfers: s}
	return s
}

// open opens the parts not open yet, once: a part that cannot be opened
// leaves the session on those that are, and is logged.
func (s *striped) open(ctx context.Context) {
	if len(s.parts) == s.want || s.dialErr != nil || s.parts[0].lease != nil {
		return
	}
	for i := len(s.parts); i < s.want; i++ {
		c, err := s.dial(ctx, i)
		if err == nil && s.parts[0].within { // opened within a transfer: under its generation
			if err = c.Continue(ctx, s.parts[0].epoch); err != nil {
				c.Close()
			}
		}
		if err != nil {
			s.dialErr = err
			logs.Printf(logs.Warn, "could not open data connection %d of tcp_stripes %d; striping over %d: %v", i+1, s.want, len(s.parts), err)
			return
		}
		s.parts = append(s.parts, c)
	}
}

// BeginTransfer puts every part's writes under the first's generation
// (transport.TransferBound).
func (s *striped) BeginTransfer(ctx context.Context) error {
	if err := s.parts[0].BeginTransfer(ctx); err != nil {
		return err
	}
	for _, c := range s.parts[1:] {
		if err := c.Continue(ctx, s.parts[0].epoch); err != nil {
			return err
		}
	}
	return nil
}

func (s *striped) EndTransfer() {
	for _, c := range s.parts {
		c.EndTransfer()
	}
}

func (s *striped) Epoch() uint64 { return s.parts[0].Epoch() }

// PeerReach: the parts share the target's table.
func (s *striped) PeerReach(dst uint64) uint64 { return s.parts[0].PeerReach(dst) }

func (s *striped) Continue(ctx context.Context, epoch uint64) error {
	for _, c := range s.parts {
		if err := c.Continue(ctx, epoch); err != nil {
			return err
		}
	}
	return nil
}

// share cuts descs into one run per open part (s.runs): contiguous, of
// about equal bytes, inside descriptors unless whole; a small batch is
// one run, on the first part. It returns how many parts have a run.
func (s *striped) share(ctx context.Context, descs []desc.Desc, base int, whole bool) int {
	clear(s.runs)
	var total uint64
	for _, d := range descs {
		total += d.Len
	}
	if total >= stripeMin {
		s.open(ctx)
	}
	k := len(s.parts)
	if total < stripeMin || k == 1 {
		s.runs[0] = stripeRun{descs, base}
		return 1
	}
	if whole {
		return s.shareWhole(descs, base, total, k)
	}
	return s.shareBytes(descs, base, total, k)
}

// shareWhole cuts after the descriptor at which a part has its share.
func (s *striped) shareWhole(descs []desc.Desc, base int, total uint64, k int) int {
	p, from := 0, 0
	var sum uint64
	for i, d := range descs {
		sum += d.Len
		if p < k-1 && sum*uint64(k) >= total*uint64(p+1) {
			s.runs[p] = stripeRun{descs[from : i+1], base + from}
			p, from = p+1, i+1
		}
	}
	if from < len(descs) {
		s.runs[p] = stripeRun{descs[from:], base + from}
		p++
	}
	return p
}

// shareBytes cuts the batch at about every total/k bytes. A cut inside a
// descriptor falls on the descriptor's MaxSlice grid, where one
// connection cuts its frames anyway: the frames, and the slice ends that
// tail and sample read back, are those of an unstriped batch (a torn
// frame ending anywhere else would escape tail); a descriptor of at most
// MaxSlice is never cut.
func (s *striped) shareBytes(descs []desc.Desc, base int, total uint64, k int) int {
	share := (total + uint64(k) - 1) / uint64(k)
	bounds := append(s.bounds[:0], 0)
	var at uint64 // the batch offset of descs[i]
	i := 0
	for p := 1; p < k; p++ {
		want := uint64(p) * share
		for i < len(descs) && at+descs[i].Len <= want {
			at += descs[i].Len
			i++
		}
		if i == len(descs) {
			break
		}
		g := min((want-at+transport.MaxSlice/2)/transport.MaxSlice*transport.MaxSlice, descs[i].Len)
		if cut := at + g; cut > bounds[len(bounds)-1] {
			bounds = append(bounds, cut)
		}
	}
	if bounds[len(bounds)-1] < total {
		bounds = append(bounds, total)
	}
	s.bounds = bounds
	n := len(bounds) - 1
	for p := range n {
		s.cut[p] = s.cut[p][:0]
	}
	p := 0
	at = 0
	for i, d := range descs {
		for lo := at; lo < at+d.Len; {
			for bounds[p+1] <= lo {
				p++
			}
			hi := min(at+d.Len, bounds[p+1])
			if len(s.cut[p]) == 0 {
				s.runs[p].base = base + i
			}
			s.cut[p] = append(s.cut[p], desc.Desc{Src: d.Src + (lo - at), Dst: d.Dst + (lo - at), Len: hi - lo})
			lo = hi
		}
		at += d.Len
	}
	for p := range n {
		s.runs[p].descs = s.cut[p]
		if cap(s.cut[p]) > maxKeptCut {
			s.cut[p] = nil // do not keep a huge batch's room
		}
	}
	return n
}

// maxKeptCut bounds the descriptors a part's cut buffer keeps.
const maxKeptCut = 4096

// each sends every part's run with send, concurrently where there are
// several.
func (s *striped) each(ctx context.Context, descs []desc.Desc, base int, whole bool, send func(c *conn, run []desc.Desc, base int) error) error {
	n := s.share(ctx, descs, base, whole)
	if n == 1 {
		s.written[0] = true
		return send(s.parts[0], s.runs[0].descs, s.runs[0].base)
	}
	return transport.Each(n, func(i int) bool { return len(s.runs[i].descs) > 0 }, func(i int) error {
		s.written[i] = true
		return send(s.parts[i], s.runs[i].descs, s.runs[i].base)
	})
}

func (s *striped) Write(ctx context.Context, descs []desc.Desc, base int) error {
	return s.each(ctx, descs, base, false, func(c *conn, run []desc.Desc, base int) error { return c.Write(ctx, run, base) })
}

func (s *striped) Post(ctx context.Context, descs []desc.Desc, base int) error {
	return s.each(ctx, descs, base, false, func(c *conn, run []desc.Desc, base int) error { return c.Post(ctx, run, base) })
}

func (s *striped) PostMarked(ctx context.Context, descs []desc.Desc, base int) error {
	return s.each(ctx, descs, base, true, func(c *conn, run []desc.Desc, base int) error { return c.PostMarked(ctx, run, base) })
}

// fenceOthers fences every written part but the first.
func (s *striped) fenceOthers(ctx context.Context) error {
	others := false
	for i := 1; i < len(s.parts); i++ {
		others = others || s.written[i]
	}
	if !others {
		return nil
	}
	return transport.Each(len(s.parts), func(i int) bool { return i > 0 && s.written[i] }, func(i int) error {
		s.written[i] = false
		return s.parts[i].Fence(ctx)
	})
}

func (s *striped) Fence(ctx context.Context) error {
	if err := s.fenceOthers(ctx); err != nil {
		return err
	}
	s.written[0] = false
	return s.parts[0].Fence(ctx)
}

// Read reads back on the first part; with fenced, the others are fenced
// first and the first's fence goes with the read, in one flight.
func (s *striped) Read(ctx context.Context, ranges []desc.Range, out []byte, fenced bool) error {
	if fenced {
		if err := s.fenceOthers(ctx); err != nil {
			return err
		}
		s.written[0] = false
	}
	return s.parts[0].Read(ctx, ranges, out, fenced)
}

func (s *striped) FenceIsFinal() bool    { return s.parts[0].FenceIsFinal() }
func (s *striped) Caps() *transport.Caps { return &s.caps }

// PostNotice sends the notice on the first part once the others' writes
// are applied: the receiver may sync as soon as it arrives.
func (s *striped) PostNotice(ctx context.Context, body []byte, fenceFollows bool) error {
	if err := s.fenceOthers(ctx); err != nil {
		return err
	}
	return s.parts[0].PostNotice(ctx, body, fenceFollows)
}

// SettleNotices: notices go on the first part.
func (s *striped) SettleNotices(ctx context.Context) error { return s.parts[0].SettleNotices(ctx) }

// Refresh: the parts share one region table.
func (s *striped) Refresh(answer []byte, regions []memory.Region) error {
	return s.parts[0].Refresh(answer, regions)
}

func (s *striped) Close() {
	for _, c := range s.parts {
		c.Close()
	}
}

var _ transport.Conn = (*striped)(nil)
