package core

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"

	zmq "github.com/pebbe/zmq4"

	"github.com/mcguard/mcguard/core/wire"
	"github.com/mcguard/mcguard/verify"
)

// MaxDescriptors bounds one call's batch; larger counts are refused
// rather than risk an overflowing allocation. Within it, any count works.
const MaxDescriptors = 1 << 24

// Guard is one mcguard instance: a sender to any number of sessions and a
// target that peers write into.
type Guard struct {
	cfg     Config
	regions *Regions
	zctx    *zmq.Context
	control *controlServer
	target  *target

	ctx    context.Context // cancelled by Close: aborts every wait
	cancel context.CancelFunc

	mu       sync.Mutex
	closed   bool
	sessions map[string]*session
	inflight sync.WaitGroup

	nextTransfer atomic.Uint64
	stats        counters
}

type counters struct {
	transfers, ok, failed, descriptors, bytes, retries, verifyFailures, probed atomic.Int64
}

// Open starts a guard: its target server and control endpoint.
func Open(cfg Config) (*Guard, error) {
	host, _, err := net.SplitHostPort(cfg.Listen)
	if err != nil {
		return nil, fmt.Errorf("%w: listen %q: %v", ErrConfig, cfg.Listen, err)
	}
	token := make([]byte, wire.TokenSize)
	if _, err := rand.Read(token); err != nil {
		return nil, fmt.Errorf("%w: random token: %v", ErrConfig, err)
	}
	g := &Guard{cfg: cfg, regions: &Regions{}, sessions: map[string]*session{}}
	g.ctx, g.cancel = context.WithCancel(context.Background())
	if g.zctx, err = zmq.NewContext(); err != nil {
		return nil, fmt.Errorf("%w: zmq context: %v", ErrConfig, err)
	}
	if g.target, err = newTarget(g.regions, token, host, cfg.Timeout, cfg.Inject); err != nil {
		g.zctx.Term()
		return nil, err
	}
	answer := func(helloRequest) helloReply {
		return helloReply{Proto: ProtocolVersion, Data: g.target.addr(), Token: token, Regions: g.regions.Snapshot()}
	}
	if g.control, err = newControlServer(g.zctx, cfg.Listen, answer); err != nil {
		g.target.close()
		g.zctx.Term()
		return nil, err
	}
	return g, nil
}

// Endpoint is the "host:port" peers use as this guard's session name.
func (g *Guard) Endpoint() string { return g.control.endpoint }

// Config returns the guard's settings.
func (g *Guard) Config() Config { return g.cfg }

func (g *Guard) enter() error {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.closed {
		return fmt.Errorf("%w", ErrClosed)
	}
	g.inflight.Add(1)
	return nil
}

// Close stops the guard. Calls in flight on other threads return an
// error; Close waits for them before it releases anything.
func (g *Guard) Close() error {
	g.mu.Lock()
	if g.closed {
		g.mu.Unlock()
		return fmt.Errorf("%w: already closed", ErrClosed)
	}
	g.closed = true
	g.mu.Unlock()
	g.cancel()
	g.inflight.Wait()
	for _, s := range g.sessions {
		s.disconnect()
	}
	g.control.close()
	g.target.close()
	g.zctx.Term()
	return nil
}

// Register makes [addr, addr+n) usable as a source and writable by peers.
func (g *Guard) Register(addr, n uint64) error {
	if err := g.enter(); err != nil {
		return err
	}
	defer g.inflight.Done()
	return g.regions.Add(addr, n)
}

// Unregister removes the region that starts at addr, waiting for accesses
// in progress to finish.
func (g *Guard) Unregister(addr uint64) error {
	if err := g.enter(); err != nil {
		return err
	}
	defer g.inflight.Done()
	return g.regions.Remove(addr)
}

// TransferOptions adjusts one call.
type TransferOptions struct {
	Verify *verify.Mode // nil: the guard's mode
}

// TransferResult describes a successful transfer.
type TransferResult struct {
	ID      uint64
	Retries int
}

// Transfer writes every descriptor to session and returns nil only after
// the configured verification confirmed the bytes at the target.
func (g *Guard) Transfer(name string, descs []verify.Desc, opts TransferOptions) (TransferResult, error) {
	if err := g.enter(); err != nil {
		return TransferResult{}, err
	}
	defer g.inflight.Done()
	g.stats.transfers.Add(1)
	res, err := g.transfer(name, descs, opts)
	if err != nil {
		g.stats.failed.Add(1)
		if errors.Is(err, ErrVerify) {
			g.stats.verifyFailures.Add(1)
		}
		if g.ctx.Err() != nil && !errors.Is(err, ErrClosed) {
			err = fmt.Errorf("%w while the transfer was in flight: %v", ErrClosed, err)
		}
		return res, err
	}
	g.stats.ok.Add(1)
	return res, nil
}

// checkBatch validates a batch whose local side is Src and remote side
// Dst, and returns its byte count.
func (g *Guard) checkBatch(name string, descs []verify.Desc) (uint64, error) {
	if len(descs) == 0 {
		return 0, fmt.Errorf("%w: a transfer needs at least one descriptor", ErrInvalidArg)
	}
	if len(descs) > MaxDescriptors {
		return 0, fmt.Errorf("%w: %d descriptors, limit %d per call", ErrInvalidArg, len(descs), MaxDescriptors)
	}
	if err := validSessionName(name); err != nil {
		return 0, err
	}
	var total uint64
	for i, d := range descs {
		if d.Len == 0 {
			return 0, fmt.Errorf("%w: descriptor %d has length 0", ErrInvalidArg, i)
		}
		if err := g.regions.Check(d.Src, d.Len); err != nil {
			return 0, fmt.Errorf("descriptor %d local side: %w", i, err)
		}
		if d.Dst+d.Len < d.Dst {
			return 0, fmt.Errorf("%w: descriptor %d remote address %#x+%d wraps", ErrInvalidArg, i, d.Dst, d.Len)
		}
		total += d.Len
	}
	return total, nil
}

// lockSession returns name's session locked, connected, and with a region
// table that covers every remote range of descs. The caller unlocks it.
func (g *Guard) lockSession(name string, descs []verify.Desc) (*session, error) {
	s := g.session(name)
	s.mu.Lock()
	err := s.connect(g.ctx, g.zctx, &g.cfg)
	if err == nil {
		if i := s.checkDst(descs); i >= 0 {
			if err = s.refresh(g.ctx, g.zctx, &g.cfg); err == nil {
				if i = s.checkDst(descs); i >= 0 {
					err = fmt.Errorf("descriptor %d remote side: %w at session %s: [%#x, +%d)", i, ErrNotRegistered, name, descs[i].Dst, descs[i].Len)
				}
			}
		}
	}
	if err != nil {
		s.mu.Unlock()
		return nil, err
	}
	return s, nil
}

func (g *Guard) transfer(name string, descs []verify.Desc, opts TransferOptions) (TransferResult, error) {
	var res TransferResult
	total, err := g.checkBatch(name, descs)
	if err != nil {
		return res, err
	}
	vcfg := g.cfg.Verify
	if opts.Verify != nil {
		vcfg.Mode = *opts.Verify
	}
	s, err := g.lockSession(name, descs)
	if err != nil {
		return res, err
	}
	defer s.mu.Unlock()
	local := func(addr, n uint64) []byte { return bytesAt(addr, n) }
	for base := 0; base < len(descs); base += g.cfg.MaxBatch {
		chunk := descs[base:min(base+g.cfg.MaxBatch, len(descs))]
		if err := s.conn.write(g.ctx, chunk, base, g.regions); err != nil {
			s.disconnect()
			return res, err
		}
		vr, err := verify.Check(g.ctx, vcfg, chunk, base, local, s.conn.read, &s.scratch)
		res.Retries += vr.Retries
		g.stats.retries.Add(int64(vr.Retries))
		g.stats.probed.Add(vr.Probed)
		if err != nil {
			if !errors.Is(err, ErrVerify) {
				s.disconnect()
			}
			return res, fmt.Errorf("session %s: %w", name, err)
		}
	}
	g.stats.descriptors.Add(int64(len(descs)))
	g.stats.bytes.Add(int64(total))
	res.ID = g.nextTransfer.Add(1)
	return res, nil
}

// Read copies remote bytes into local registered memory: for each
// descriptor, Len bytes from the session's Dst into local Src.
func (g *Guard) Read(name string, descs []verify.Desc) error {
	if err := g.enter(); err != nil {
		return err
	}
	defer g.inflight.Done()
	if _, err := g.checkBatch(name, descs); err != nil {
		return err
	}
	s, err := g.lockSession(name, descs)
	if err != nil {
		return err
	}
	defer s.mu.Unlock()
	// Pieces of at most one wire slice, fetched in groups that fit a reply.
	type piece struct{ local, remote, n uint64 }
	var group []piece
	var ranges []verify.Range
	var size uint64
	flush := func() error {
		if len(group) == 0 {
			return nil
		}
		buf := s.scratch.Bytes(size)
		if err := s.conn.read(g.ctx, ranges, buf); err != nil {
			s.disconnect()
			return fmt.Errorf("session %s: %w", name, err)
		}
		for _, p := range group {
			g.regions.Access(p.local, p.n, func(m []byte) error { copy(m, buf[:p.n]); return nil })
			buf = buf[p.n:]
		}
		group, ranges, size = group[:0], ranges[:0], 0
		return nil
	}
	for _, d := range descs {
		for off := uint64(0); off < d.Len; off += wire.WriteSlice {
			n := min(wire.WriteSlice, d.Len-off)
			if size+n > wire.MaxPayload || len(ranges) == wire.MaxRanges {
				if err := flush(); err != nil {
					return err
				}
			}
			group = append(group, piece{d.Src + off, d.Dst + off, n})
			ranges = append(ranges, verify.Range{Addr: d.Dst + off, Len: n})
			size += n
		}
	}
	return flush()
}

func (g *Guard) session(name string) *session {
	g.mu.Lock()
	defer g.mu.Unlock()
	s, ok := g.sessions[name]
	if !ok {
		s = &session{name: name}
		g.sessions[name] = s
	}
	return s
}

// SyncRange is one destination range the receiver was told is complete.
type SyncRange struct{ Addr, Len uint64 }

// Sync is the receiver's half: after the sender's notice, it checks that
// every range is registered memory of this guard and makes the bytes safe
// for the application. For host memory a completed target write is
// already visible (the target applies before it acknowledges), so this
// is a check plus a full fence; device memory adds its flush later.
func (g *Guard) Sync(ranges []SyncRange) error {
	if err := g.enter(); err != nil {
		return err
	}
	defer g.inflight.Done()
	if len(ranges) > MaxDescriptors {
		return fmt.Errorf("%w: %d ranges, limit %d per call", ErrInvalidArg, len(ranges), MaxDescriptors)
	}
	for i, r := range ranges {
		if err := g.regions.Check(r.Addr, r.Len); err != nil {
			return fmt.Errorf("sync range %d: %w", i, err)
		}
	}
	var fence atomic.Int64
	fence.Add(1) // a locked instruction: a full memory barrier on every architecture Go supports
	return nil
}

// Stats returns counters and settings as JSON.
func (g *Guard) Stats() ([]byte, error) {
	if err := g.enter(); err != nil {
		return nil, err
	}
	defer g.inflight.Done()
	g.mu.Lock()
	nsessions := len(g.sessions)
	g.mu.Unlock()
	return json.Marshal(map[string]any{
		"endpoint":        g.Endpoint(),
		"data_endpoint":   g.target.addr(),
		"verify":          g.cfg.Verify.Mode,
		"inject":          g.cfg.Inject.Mode,
		"transport":       "tcp",
		"max_batch":       g.cfg.MaxBatch,
		"sessions":        nsessions,
		"regions":         len(g.regions.Snapshot()),
		"transfers":       g.stats.transfers.Load(),
		"ok":              g.stats.ok.Load(),
		"failed":          g.stats.failed.Load(),
		"descriptors":     g.stats.descriptors.Load(),
		"bytes":           g.stats.bytes.Load(),
		"retries":         g.stats.retries.Load(),
		"verify_failures": g.stats.verifyFailures.Load(),
		"probed_bytes":    g.stats.probed.Load(),
	})
}
