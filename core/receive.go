package core

import (
	"context"
	"crypto/hmac"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/mcguard/mcguard/core/memory"
	"github.com/mcguard/mcguard/core/transport"
	"github.com/mcguard/mcguard/core/wire"
	"github.com/mcguard/mcguard/verify"
)

// The receiver: completion notices as they arrive, and the application's
// sync calls that settle the ranges they name and compare digests.

// receiveNotice records a peer's notice; the reply says whether it was
// taken. A notice that is malformed or names memory this guard did not
// register is refused whole.
func (g *Guard) receiveNotice(body []byte) []byte {
	rep := controlReply{Proto: ProtocolVersion}
	if err := g.takeNotice(body, nil); err != nil {
		rep.Error = err.Error()
		if errors.Is(err, errUnknownNoticeToken) {
			rep.Code = codeUnknownToken
		}
	}
	out, _ := json.Marshal(rep)
	return out
}

// takeNotice records a notice, from the control channel or a data
// connection: it must decode, prove its handshake (token, sequence, MAC)
// and name only memory registered here.
func (g *Guard) takeNotice(body []byte, landed transport.Landed) error {
	n, err := wire.DecodeNotice(body, len(verify.Modes))
	if err == nil {
		_, err = g.auth.tokens.notice(n.Token, n.Seq, func(key []byte) bool { m := noticeMAC(key, body); return hmac.Equal(n.MAC, m[:]) })
	}
	if err == nil {
		for i, d := range n.Descs {
			if g.regions.Check(d.Dst, d.Len) != nil {
				err = fmt.Errorf("notice descriptor %d names [%#x, +%d), which is not registered here", n.Base+i, d.Dst, d.Len)
				break
			}
		}
	}
	if err == nil {
		err = g.notices.add(n, landed)
	}
	if err == nil {
		g.stats.noticesReceived.Add(1)
		g.metrics.noticesReceived.Add(1)
	}
	return err
}

// SyncRange is one destination range the receiver was told is complete.
type SyncRange struct{ Addr, Len uint64 }

// Sync is the receiver's half for ranges the application was told about
// (the vLLM connector's own OK message): it waits until writes still in
// flight to them have landed, makes them safe to read (the device hook: a
// full fence for host memory) and, when digests are given (one per range,
// as the sender's mc_guard_transfer returned them), compares them.
func (g *Guard) Sync(ranges []SyncRange, digests []uint64, stream uint64) (err error) {
	if err := g.enter(); err != nil {
		return err
	}
	defer g.inflight.Done()
	defer func() { g.metrics.syncs.Add(1, outcomeOf(err)) }()
	if len(ranges) > MaxDescriptors {
		return fmt.Errorf("%w: %d ranges, limit %d per call", ErrInvalidArg, len(ranges), MaxDescriptors)
	}
	if digests != nil && len(digests) != len(ranges) {
		return fmt.Errorf("%w: %d digests for %d ranges", ErrInvalidArg, len(digests), len(ranges))
	}
	for i, r := range ranges {
		if err := g.regions.Check(r.Addr, r.Len); err != nil {
			return fmt.Errorf("sync range %d: %w", i, err)
		}
	}
	ctx, cancel := context.WithTimeout(g.ctx, g.cfg.SyncTimeout)
	defer cancel()
	return g.settle(ctx, ranges, digests, func() string { return "range" }, stream)
}

// SyncTransfers is the receiver's half for transfers announced by
// completion notices: it waits (up to sync_timeout) for each transfer's
// notice, then settles its ranges as Sync does, comparing digests when the
// transfer was sent in digest mode.
func (g *Guard) SyncTransfers(ids []uint64, stream uint64) (err error) {
	if err := g.enter(); err != nil {
		return err
	}
	defer g.inflight.Done()
	defer func() { g.metrics.syncs.Add(1, outcomeOf(err)) }()
	if len(ids) == 0 || len(ids) > MaxDescriptors {
		return fmt.Errorf("%w: %d transfer ids (1 to %d)", ErrInvalidArg, len(ids), MaxDescriptors)
	}
	ctx, cancel := context.WithTimeout(g.ctx, g.cfg.SyncTimeout)
	defer cancel()
	for _, id := range ids {
		n, err := g.notices.take(ctx, id)
		if err != nil {
			g.stats.syncFailures.Add(1)
			return err
		}
		ranges := make([]SyncRange, len(n.descs))
		var digests []uint64
		if n.mode == verify.Digest {
			digests = make([]uint64, len(n.descs))
		}
		for i, d := range n.descs {
			ranges[i] = SyncRange{Addr: d.Dst, Len: d.Len}
			if digests != nil {
				digests[i] = d.Digest
			}
		}
		if err := g.settleLanded(ctx, ranges, digests, n.landed, func() string { return fmt.Sprintf("transfer %#x descriptor", id) }, stream); err != nil {
			return err
		}
	}
	return nil
}

// settle waits for writes in flight to ranges, runs the device hook (for
// each GPU the ranges are on: flush GPUDirect writes, then synchronise the
// caller's stream or the context), and compares digests if there are any.
func (g *Guard) settle(ctx context.Context, ranges []SyncRange, digests []uint64, what func() string, stream uint64) error {
	return g.settleLanded(ctx, ranges, digests, nil, what, stream)
}

// settleLanded is settle where the target may have digested some of the
// ranges as they landed: those digests are compared instead of reading
// the memory again (digest_at "landing").
func (g *Guard) settleLanded(ctx context.Context, ranges []SyncRange, digests []uint64, landed []transport.Landed, what func() string, stream uint64) error {
	g.stats.syncs.Add(1)
	regions := make([]memory.Region, len(ranges))
	for i, r := range ranges {
		regions[i] = memory.Region(r)
	}
	for _, p := range g.planes {
		if err := p.Settle(ctx, regions); err != nil {
			g.stats.syncFailures.Add(1)
			return fmt.Errorf("%w: %s writes to the synced ranges were still in flight after %v", ErrTimeout, p.Name(), g.cfg.SyncTimeout)
		}
	}
	// Host memory needs no hook: the target applied its writes before it
	// acknowledged them, and the application learned of the transfer
	// through a message (a syscall), which orders memory. GPU memory does:
	for _, ordinal := range g.regions.Devices(regions) {
		if err := g.regions.GPU().Settle(ordinal, stream); err != nil {
			g.stats.syncFailures.Add(1)
			return fmt.Errorf("%w: GPU %d: %v", ErrDevice, ordinal, err)
		}
	}
	if digests == nil {
		return nil
	}
	vr := make([]verify.Range, len(ranges))
	for i, r := range ranges {
		vr[i] = verify.Range(r)
	}
	digest := func(r verify.Range) (uint64, error) {
		for _, l := range landed {
			if d, ok := l.Digest(r.Addr, r.Len); ok {
				g.stats.digestsLanded.Add(1)
				return d, nil
			}
		}
		g.stats.digestsRead.Add(1)
		return g.regions.Digest(r.Addr, r.Len)
	}
	defer func() {
		for _, l := range landed {
			l.Release()
		}
	}()
	if err := verify.CompareDigests(vr, digests, digest, what); err != nil {
		g.stats.syncFailures.Add(1)
		return err
	}
	return nil
}
