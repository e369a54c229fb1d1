package core

import (
	"context"
	"errors"
	"fmt"

	"github.com/mcguard/mcguard/core/wire"
	"github.com/mcguard/mcguard/verify"
)

// Completion notices, the sender's side: a chunk's notice goes on the
// data connection after its writes (TCP) or over the control channel.
//
// On the data connection its answer is read by the fence that follows,
// in the same flight, except where that fence has nothing else to wait
// for (same host: the sender wrote the bytes itself). There the answer is
// left owed and read at the session's next chunk (settleNotices), so the
// transfer costs no round trip; a refusal surfaces there: under a stale
// handshake the notice is announced again, any other is counted
// (notices_undelivered) and fails that call, naming the transfer. The
// receiver's sync of a notice that never arrived fails at sync_timeout,
// saying so.

// sentNotice is the last chunk's notice, kept (its descriptors in the
// session's buffer) until its answer is read: to announce it again.
type sentNotice struct {
	id          uint64
	mode        verify.Mode
	total, base int
	descs       []wire.NoticeDesc
}

// notify sends one chunk's completion notice to the session's guard; with
// fenceFollows the caller fences the data connection next, which carries
// a notice posted on it.
func (g *Guard) notify(ctx context.Context, s *session, id uint64, mode verify.Mode, total, base int, chunk []verify.Desc, digests []uint64, fenceFollows bool) error {
	descs := keep(s.noticeDescs)
	for i, d := range chunk {
		nd := wire.NoticeDesc{Dst: d.Dst, Len: d.Len}
		if digests != nil {
			nd.Digest = digests[i]
		}
		descs = append(descs, nd)
	}
	s.noticeDescs = descs
	s.lastNotice = sentNotice{id: id, mode: mode, total: total, base: base, descs: descs}
	return g.announce(ctx, s, &s.lastNotice, fenceFollows)
}

// announce sends n in parts of at most wire.MaxNoticeDescs descriptors.
func (g *Guard) announce(ctx context.Context, s *session, n *sentNotice, fenceFollows bool) error {
	if err := s.greet(ctx, g); err != nil {
		return err
	}
	for off := 0; off < len(n.descs); off += wire.MaxNoticeDescs {
		part := wire.Notice{ID: n.id, Mode: modeIndex(n.mode), Total: n.total, Base: n.base + off,
			Descs: n.descs[off:min(off+wire.MaxNoticeDescs, len(n.descs))]}
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
	if p, ok := s.conn.(noticePoster); ok {
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

// noticePoster is a data connection that carries completion notices
// itself (TCP), in order after the writes.
type noticePoster interface {
	PostNotice(ctx context.Context, body []byte, fenceFollows bool) error
}

// noticeSettler is a noticePoster that may leave a notice's answer owed
// past the call that sent it; SettleNotices reads it.
type noticeSettler interface {
	SettleNotices(ctx context.Context) error
}

// settleNotices reads the answers an earlier call left owed, before this
// chunk's writes: a stale handshake's refusal announces the last notice
// again under a new one; any other failure is the notice's, reported by
// this call (nothing of it is sent yet).
func (g *Guard) settleNotices(ctx context.Context, s *session) error {
	ns, ok := s.conn.(noticeSettler)
	if !ok {
		return nil
	}
	err := ns.SettleNotices(ctx)
	if err == nil {
		return nil
	}
	if errors.Is(err, errUnknownToken) && s.lastNotice.id != 0 {
		if err = s.refresh(ctx, g); err == nil {
			if err = g.announce(ctx, s, &s.lastNotice, false); err == nil {
				err = ns.SettleNotices(ctx)
			}
		}
		if err == nil {
			return nil
		}
	}
	g.stats.noticesUndelivered.Add(1)
	g.metrics.noticesUndelivered.Add(1)
	return fmt.Errorf("the completion notice of an earlier transfer, %#x, may not have reached the receiver (its sync of that transfer will fail): %w", s.lastNotice.id, err)
}
