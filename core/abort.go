package core

import (
	"context"
	"crypto/hmac"
	"encoding/binary"
	"errors"
	"fmt"
	"time"

	"github.com/mcguard/mcguard/core/auth"
	"github.com/mcguard/mcguard/core/control"
	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/core/memory"
	"github.com/mcguard/mcguard/core/transport"
)

// Aborts: a transfer that fails, times out or is cancelled returns only
// after its own writes are cut off locally (its connection reset, its
// queue pairs destroyed), and says whether the receiver confirmed that
// nothing more of them will land. The receiver's half is Quiesce: after it
// returns, the ranges may be reused, whatever a sender still has on its way.

// AbortState says, for a failed transfer, what is known of its bytes
// still on their way.
type AbortState int

const (
	AbortNone        AbortState = iota // nothing was sent, or the transfer succeeded
	AbortConfirmed                     // the receiver confirmed that nothing more of it will land
	AbortUnconfirmed                   // unknown (the receiver did not answer): quiesce before reuse
)

func (a AbortState) String() string {
	return [...]string{"none", "confirmed", "unconfirmed"}[a]
}

var (
	errCancelled = errors.New("cancelled by the caller")
	errDeadline  = errors.New("past the transfer's deadline")
)

// callGen is the context the session's calls share until Cancel: one
// context for every call, not one each (a transfer allocates nothing for
// it), cancelled by Cancel and then replaced for later calls.
type callGen struct {
	ctx    context.Context
	cancel context.CancelCauseFunc
	n      int // calls in flight under it (under cmu)
}

// call is one call's hold on its generation, and its deadline's timer.
type call struct {
	gen       *callGen
	stopTimer context.CancelFunc
}

// callContext is one transfer's context: the guard's, ended by Cancel of
// the session and, with a deadline, when it passes. endCall releases it.
func (s *session) callContext(parent context.Context, deadline time.Duration) (context.Context, call) {
	s.cmu.Lock()
	if s.gen == nil {
		ctx, cancel := context.WithCancelCause(parent)
		s.gen = &callGen{ctx: ctx, cancel: cancel}
	}
	c := call{gen: s.gen}
	c.gen.n++
	s.cmu.Unlock()
	ctx := c.gen.ctx
	if deadline > 0 {
		ctx, c.stopTimer = context.WithTimeoutCause(ctx, deadline, errDeadline)
	}
	return ctx, c
}

// endCall ends what callContext began.
func (s *session) endCall(c call) {
	if c.stopTimer != nil {
		c.stopTimer()
	}
	s.cmu.Lock()
	c.gen.n--
	s.cmu.Unlock()
}

// cancelCalls cancels every transfer in flight to the session; later
// calls get a fresh context.
func (s *session) cancelCalls() int {
	s.cmu.Lock()
	defer s.cmu.Unlock()
	if s.gen == nil || s.gen.n == 0 {
		return 0
	}
	s.gen.cancel(errCancelled)
	n := s.gen.n
	s.gen = nil
	return n
}

// callErr names why a transfer's context ended, where it did: cancelled
// (ErrCancelled) or past its deadline (ErrTimeout). A closing guard is
// left to Transfer (ErrClosed).
func callErr(ctx context.Context, err error) error {
	switch context.Cause(ctx) {
	case errCancelled:
		return fmt.Errorf("%w: %v", errs.Cancelled, err)
	case errDeadline:
		return fmt.Errorf("%w: %v: %v", errs.Timeout, errDeadline, err)
	}
	return err
}

// Cancel cancels the transfers in flight to session: each returns
// ErrCancelled once its writes are cut off, with its abort state.
func (g *Guard) Cancel(session string) error {
	if err := g.enterSession(session); err != nil {
		return err
	}
	defer g.leave()
	g.mu.Lock()
	s := g.sessions[session]
	g.mu.Unlock()
	if s != nil && s.cancelCalls() > 0 {
		g.stats.cancels.Add(1)
	}
	return nil
}

// abortMAC binds an abort request to the handshake's key, its token and a
// sequence number above the last one used under it.
func abortMAC(key, token []byte, seq uint64) []byte {
	return auth.MAC(key, auth.LabelAbort, token, binary.LittleEndian.AppendUint64(nil, seq))
}

// abortRemote runs after a failed transfer whose writes may be on their
// way: it resets the session's connection (bytes still queued on it are
// dropped) and asks the receiver to make sure nothing more of this
// session's lands, over the control channel.
func (g *Guard) abortRemote(s *session) AbortState {
	s.disconnect()
	if len(s.hello.Token) == 0 || g.engine != nil { // an engine's writes pass no guard at the target
		return AbortUnconfirmed
	}
	ctx, cancel := context.WithTimeout(g.ctx, g.cfg.ConnectTimeout)
	defer cancel()
	sock, _, err := control.NewReqSocket(ctx, g.zctx, s.control, g.cfg.ConnectTimeout)
	if err != nil {
		return AbortUnconfirmed
	}
	defer sock.Close()
	s.seq++
	req := control.Hello{Proto: control.ProtocolVersion, Op: "abort", Nonce: auth.RandomBytes(auth.NonceSize), Transport: g.handshakeTransport(),
		Token: s.hello.Token, Seq: s.seq, MAC: abortMAC(s.hello.Key, s.hello.Token, s.seq)}
	if _, err := control.HandshakeStep(ctx, sock, s.control, g.cfg.ConnectTimeout, req); err != nil {
		return AbortUnconfirmed
	}
	return AbortConfirmed
}

// answerAbort is the receiver's half of an abort: a request under a live
// handshake's token, with its MAC and a fresh sequence number, makes every
// data plane cut off that sender's connections.
func (g *Guard) answerAbort(req control.Hello) error {
	sender, err := g.auth.Tokens.Notice(req.Token, req.Seq, func(key []byte) bool {
		return hmac.Equal(req.MAC, abortMAC(key, req.Token, req.Seq))
	})
	if err != nil {
		return err
	}
	for _, p := range g.planes {
		if err := p.Abort(transport.Peer{Sender: sender}); err != nil {
			return fmt.Errorf("%s: %v", p.Name(), err)
		}
	}
	g.stats.abortsAnswered.Add(1)
	return nil
}

// Quiesce is the receiver's call before it reuses ranges whose transfer
// failed or whose request was aborted: it returns once no write into them
// that began before the call can still land — those being applied have
// finished, those still on their way are refused when they come — while
// other traffic goes on.
func (g *Guard) Quiesce(ranges []SyncRange) error {
	if err := g.enter(); err != nil {
		return err
	}
	defer g.leave()
	if len(ranges) > MaxDescriptors {
		return fmt.Errorf("%w: %d ranges, limit %d per call", errs.InvalidArg, len(ranges), MaxDescriptors)
	}
	regions := make([]memory.Region, len(ranges))
	for i, r := range ranges {
		if err := g.regions.Check(r.Addr, r.Len); err != nil {
			return fmt.Errorf("quiesce range %d: %w", i, err)
		}
		regions[i] = memory.Region(r)
	}
	ctx, cancel := context.WithTimeout(g.ctx, g.cfg.SyncTimeout)
	defer cancel()
	for _, p := range g.planes {
		if err := p.Quiesce(ctx, regions); err != nil {
			return fmt.Errorf("%w: %s: quiescing: %v", errs.Timeout, p.Name(), err)
		}
	}
	g.stats.quiesces.Add(1)
	g.metrics.quiesces.Add(1)
	return nil
}
