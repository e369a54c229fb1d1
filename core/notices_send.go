package core

import (
	"context"
	"errors"
	"fmt"

	"github.com/mcguard/mcguard/core/desc"
	"github.com/mcguard/mcguard/core/reuse"
	"github.com/mcguard/mcguard/core/wire"
	"github.com/mcguard/mcguard/verify"
)

// Completion notices, the sender's side: a chunk's notice goes on the
// data connection after its writes (TCP) or over the control channel.
//
// On the data connection its answer is read by the fence that follows,
// in the same flight, except where that fence has nothing else to wait
// for (same host: the sender wrote the bytes itself). There the answer is
// left owed and read by a later call as it arrives (settleNotices), so
// the transfer costs no round trip; a refusal fails that call before it
// sends anything, naming the transfer, and is counted
// (notices_undelivered). The receiver's sync of a notice it refused fails
// at sync_timeout, saying no notice arrived. A handshake the receiver's
// table forgot does not refuse a notice on the connection that proved it.

// notify sends one chunk's completion notice to the session's guard, in
// parts of at most wire.MaxNoticeDescs descriptors; with fenceFollows the
// caller fences the data connection next, which carries a notice posted
// on it.
func (g *Guard) notify(ctx context.Context, s *session, id uint64, mode verify.Mode, total, base int, chunk []desc.Desc, digests []uint64, fenceFollows bool) error {
	if err := s.greet(ctx, g); err != nil {
		return err
	}
	descs := reuse.Keep(s.noticeDescs)
	for i, d := range chunk {
		nd := wire.NoticeDesc{Dst: d.Dst, Len: d.Len}
		if digests != nil {
			nd.Digest = digests[i]
		}
		descs = append(descs, nd)
	}
	s.noticeDescs = descs
	for off := 0; off < len(descs); off += wire.MaxNoticeDescs {
		part := wire.Notice{ID: id, Mode: modeIndex(mode), Total: total, Base: base + off,
			Descs: descs[off:min(off+wire.MaxNoticeDescs, len(descs))]}
		if err := g.sendNotice(ctx, s, part, fenceFollows); err != nil {
			return err
		}
		g.stats.noticesSent.Add(1)
		g.metrics.noticesSent.Add(1)
	}
	return nil
}

// sendNotice signs n and sends it: on the data connection, in order after
// the chunk's writes, or over the control channel, shaking hands again
// once where the receiver forgot this session's handshake (idle, or
// crowded out).
func (g *Guard) sendNotice(ctx context.Context, s *session, n wire.Notice, fenceFollows bool) error {
	if p := s.caps().Notices; p != nil {
		return p.PostNotice(ctx, s.signNotice(n), fenceFollows)
	}
	err := s.notify(ctx, g.zctx, &g.cfg, s.signNotice(n))
	if errors.Is(err, errUnknownToken) {
		if err = s.refresh(ctx, g); err == nil {
			err = s.notify(ctx, g.zctx, &g.cfg, s.signNotice(n))
		}
	}
	return err
}

// settleNotices reads the answers earlier calls left owed, before this
// chunk's writes: a failure is an earlier notice's, reported by this call
// (nothing of it is sent yet).
func (g *Guard) settleNotices(ctx context.Context, s *session) error {
	ns := s.caps().Notices
	if ns == nil {
		return nil
	}
	if err := ns.SettleNotices(ctx); err != nil {
		g.stats.noticesUndelivered.Add(1)
		g.metrics.noticesUndelivered.Add(1)
		return fmt.Errorf("an earlier transfer's completion notice did not reach the receiver (its sync of that transfer fails): %w", err)
	}
	return nil
}
