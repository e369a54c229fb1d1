package tcp

import (
	"context"

	"github.com/mcguard/mcguard/core/memory"
	"github.com/mcguard/mcguard/core/transport"
	"github.com/mcguard/mcguard/verify"
)

// Striping (tcp_stripes): a session may use several data connections to
// one target, as UCX's lanes and Mooncake's connections do, so that one
// session is not bound by one socket (one core copying on each side). A
// batch of at least stripeMin bytes is cut into contiguous runs of whole
// descriptors of about equal bytes, one per connection, each sent by a
// goroutine of its own; a smaller batch goes on the first connection
// alone, on the caller's goroutine, so the latency path is unchanged. Each
// connection is fenced on its own; read-backs and completion notices go on
// the first once the others' fences have answered.

// MaxStripes bounds tcp_stripes.
const MaxStripes = 8

// stripeMin is the smallest batch that is striped.
const stripeMin = 1 << 20

type striped struct {
	parts   []*conn
	written []bool // since its last fence
}

// runs cuts descs into one contiguous run per part, [from, to) each, of
// about equal bytes; a small batch is one run, on the first part.
func (s *striped) runs(descs []verify.Desc) [][2]int {
	out := make([][2]int, len(s.parts))
	var total uint64
	for _, d := range descs {
		total += d.Len
	}
	if total < stripeMin {
		out[0] = [2]int{0, len(descs)}
		return out
	}
	k, from := 0, 0
	var sum uint64
	for i, d := range descs {
		sum += d.Len
		// cut after descriptor i once this part has its share
		if k < len(s.parts)-1 && sum*uint64(len(s.parts)) >= total*uint64(k+1) {
			out[k] = [2]int{from, i + 1}
			k, from = k+1, i+1
		}
	}
	if from < len(descs) {
		out[k] = [2]int{from, len(descs)}
	}
	return out
}

// each sends every part's run with send, concurrently where there are
// several.
func (s *striped) each(descs []verify.Desc, base int, send func(c *conn, run []verify.Desc, base int) error) error {
	runs := s.runs(descs)
	return transport.Each(len(s.parts), func(i int) bool { return runs[i][1] > runs[i][0] }, func(i int) error {
		s.written[i] = true
		return send(s.parts[i], descs[runs[i][0]:runs[i][1]], base+runs[i][0])
	})
}

func (s *striped) Write(ctx context.Context, descs []verify.Desc, base int) error {
	return s.each(descs, base, func(c *conn, run []verify.Desc, base int) error { return c.Write(ctx, run, base) })
}

func (s *striped) Post(ctx context.Context, descs []verify.Desc, base int) error {
	return s.each(descs, base, func(c *conn, run []verify.Desc, base int) error { return c.Post(ctx, run, base) })
}

func (s *striped) PostMarked(ctx context.Context, descs []verify.Desc, base int) error {
	return s.each(descs, base, func(c *conn, run []verify.Desc, base int) error { return c.PostMarked(ctx, run, base) })
}

// fenceOthers fences every written part but the first.
func (s *striped) fenceOthers(ctx context.Context) error {
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
func (s *striped) Read(ctx context.Context, ranges []verify.Range, out []byte, fenced bool) error {
	if fenced {
		if err := s.fenceOthers(ctx); err != nil {
			return err
		}
		s.written[0] = false
	}
	return s.parts[0].Read(ctx, ranges, out, fenced)
}

func (s *striped) FenceIsFinal() bool   { return s.parts[0].FenceIsFinal() }
func (s *striped) CarriesNotices() bool { return true }

// PostNotice sends the notice on the first part once the others' writes
// are applied: the receiver may sync as soon as it arrives.
func (s *striped) PostNotice(ctx context.Context, body []byte, fenceFollows bool) error {
	if err := s.fenceOthers(ctx); err != nil {
		return err
	}
	return s.parts[0].PostNotice(ctx, body, fenceFollows)
}

func (s *striped) Refresh([]byte, []memory.Region) error { return nil }

func (s *striped) Close() {
	for _, c := range s.parts {
		c.Close()
	}
}

var _ transport.Conn = (*striped)(nil)
