package core

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log"
	mrand "math/rand/v2"
	"net"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"

	zmq "github.com/pebbe/zmq4"

	"github.com/mcguard/mcguard/core/cuda"
	"github.com/mcguard/mcguard/core/rdma"
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

	notices      *noticeStore
	auth         *authority
	cudaState    string        // for stats: why device memory does or does not work
	rdmaState    string        // for stats: what the RDMA probe found
	rdma         *rdmaSide     // nil: the data path is TCP
	nextTransfer atomic.Uint64 // starts at a random value: ids differ across senders
	stats        counters
}

type counters struct {
	transfers, ok, failed, descriptors, bytes, retries, resends, verifyFailures, probed atomic.Int64
	noticesSent, noticesReceived, syncs, syncFailures                                   atomic.Int64
}

// Open starts a guard: its target server and control endpoint.
func Open(cfg Config) (*Guard, error) {
	host, _, err := net.SplitHostPort(cfg.Listen)
	if err != nil {
		return nil, fmt.Errorf("%w: listen %q: %v", ErrConfig, cfg.Listen, err)
	}
	g := &Guard{cfg: cfg, regions: &Regions{}, sessions: map[string]*session{}, notices: newNoticeStore(), auth: newAuthority(cfg.Secret)}
	g.nextTransfer.Store(mrand.Uint64() >> 1)
	if err := g.loadCUDA(); err != nil {
		return nil, err
	}
	if err := g.chooseTransport(); err != nil {
		return nil, err
	}
	g.ctx, g.cancel = context.WithCancel(context.Background())
	if g.zctx, err = zmq.NewContext(); err != nil {
		return nil, fmt.Errorf("%w: zmq context: %v", ErrConfig, err)
	}
	if g.target, err = newTarget(g.regions, g.auth.tokens, host, cfg.Timeout, cfg.Inject, cfg.Verify.TailBytes); err != nil {
		g.zctx.Term()
		return nil, err
	}
	handle := func(body []byte) []byte {
		if wire.IsNotice(body) {
			return g.receiveNotice(body)
		}
		out, _ := json.Marshal(g.answerHandshake(body))
		return out
	}
	if g.control, err = newControlServer(g.zctx, cfg.Listen, handle); err != nil {
		g.target.close()
		g.zctx.Term()
		return nil, err
	}
	return g, nil
}

// loadCUDA finds the driver as cfg.CUDA says.
func (g *Guard) loadCUDA() error {
	if g.cfg.CUDA == "off" {
		g.cudaState = "off"
		return nil
	}
	d, err := cuda.Shared(g.cfg.CUDALibrary)
	if err != nil {
		if g.cfg.CUDA == "required" {
			return fmt.Errorf("%w: cuda is required: %v", ErrDevice, err)
		}
		g.cudaState = "unavailable: " + err.Error()
		return nil
	}
	g.regions.gpu = d
	g.cudaState = fmt.Sprintf("driver %d", d.Version)
	return nil
}

// chooseTransport settles cfg.Transport, and says which and why: RDMA is
// probed (libibverbs, an active port) and opened, and where that fails,
// auto falls back to TCP with a log line, while rdma and require_rdma fail
// with the reason.
func (g *Guard) chooseTransport() error {
	if g.cfg.Transport == "tcp" && !g.cfg.RequireRDMA {
		g.rdmaState = "not probed (transport tcp)"
		return nil
	}
	_, err := rdma.Probe(g.cfg.VerbsLibrary)
	if err == nil {
		side, oerr := openRDMA(g.cfg.VerbsLibrary, g.cfg.RDMADevice, g.cfg.RDMAGIDIndex)
		if oerr == nil {
			g.rdma = side
			fence := "READ (the device has no FLUSH verb)"
			if side.ep.Flush() {
				fence = "FLUSH verb"
			}
			g.rdmaState = fmt.Sprintf("rdma on %s port %d, fence %s", side.ep.Device(), side.ep.Port(), fence)
			return nil
		}
		err = oerr
	}
	why := err.Error()
	g.rdmaState = why
	if g.cfg.Transport == "rdma" || g.cfg.RequireRDMA {
		return fmt.Errorf("%w: transport rdma was required, and it is not usable: %s", ErrConfig, why)
	}
	// The probe is the same for every guard of the process: say it once.
	autoFallbackLogged.Do(func() { log.Printf("mcguard: transport auto: using tcp, because: %s", why) })
	return nil
}

var autoFallbackLogged sync.Once

func (g *Guard) transportName() string {
	if g.rdma != nil {
		return "rdma"
	}
	return "tcp"
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
	g.control.stop()
	g.zctx.Term() // returns once the control socket is closed
	g.control.wait()
	g.target.close()
	if g.rdma != nil {
		g.rdma.close()
	}
	return nil
}

// Register makes [addr, addr+n) usable as a source and writable by peers.
// With a CUDA driver, the driver says whether it is device memory (and of
// which device), once, here; every later access follows that.
func (g *Guard) Register(addr, n uint64) error {
	if err := g.enter(); err != nil {
		return err
	}
	defer g.inflight.Done()
	var mem cuda.Memory
	if gpu := g.regions.gpu; gpu != nil && n > 0 && addr+n > addr {
		first, err := gpu.Classify(addr)
		if err != nil {
			return fmt.Errorf("%w: classifying %#x: %v", ErrDevice, addr, err)
		}
		last, err := gpu.Classify(addr + n - 1)
		if err != nil {
			return fmt.Errorf("%w: classifying %#x: %v", ErrDevice, addr+n-1, err)
		}
		if first != last {
			return fmt.Errorf("%w: [%#x, +%d) spans host and device memory, or two devices", ErrInvalidArg, addr, n)
		}
		mem = first
	}
	if g.rdma != nil {
		if err := g.rdma.register(addr, n, mem, g.regions.gpu); err != nil {
			return err
		}
		if err := g.regions.add(addr, n, mem); err != nil {
			g.rdma.unregister(addr)
			return err
		}
		return nil
	}
	return g.regions.add(addr, n, mem)
}

// RegisterDevice is Register for memory the caller says is on a GPU: with
// no usable driver that is an error instead of a wrong guess.
func (g *Guard) RegisterDevice(addr, n uint64) error {
	if g.regions.gpu == nil {
		return fmt.Errorf("%w: device memory at %#x, but CUDA is %s", ErrDevice, addr, g.cudaState)
	}
	if m, err := g.regions.gpu.Classify(addr); err != nil || !m.Device {
		return fmt.Errorf("%w: %#x is not device memory the CUDA driver knows", ErrDevice, addr)
	}
	return g.Register(addr, n)
}

// Unregister removes the region that starts at addr, waiting for accesses
// in progress to finish.
func (g *Guard) Unregister(addr uint64) error {
	if err := g.enter(); err != nil {
		return err
	}
	defer g.inflight.Done()
	if err := g.regions.Remove(addr); err != nil {
		return err
	}
	if g.rdma != nil {
		g.rdma.unregister(addr)
	}
	return nil
}

// TransferOptions adjusts one call.
type TransferOptions struct {
	Verify   *verify.Mode // nil: the guard's mode
	Digests  []uint64     // if len(descs): filled with each source's digest (xxh3-64)
	NoNotice bool         // do not send a completion notice even where the guard would
}

// TransferResult describes a successful transfer.
type TransferResult struct {
	ID      uint64
	Retries int
	Resends int
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
	err := s.connect(g.ctx, g.zctx, &g.cfg, g.rdma)
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
	res.ID = g.nextTransfer.Add(1)
	seed := mrand.Uint64()
	notify := !opts.NoNotice && (g.cfg.Notify == "always" || (g.cfg.Notify == "auto" && vcfg.Mode == verify.Digest))
	for base := 0; base < len(descs); base += g.cfg.MaxBatch {
		chunk := descs[base:min(base+g.cfg.MaxBatch, len(descs))]
		var digests []uint64
		wait := func() error { return nil }
		if vcfg.Mode == verify.Digest || opts.Digests != nil {
			// Digest the sources while the writes go out: the source
			// must not change during a transfer, so both see the same bytes.
			digests = make([]uint64, len(chunk))
			done := make(chan struct{})
			var digestErr error
			go func() {
				defer close(done)
				for i, d := range chunk {
					if digests[i], digestErr = g.regions.Digest(d.Src, d.Len); digestErr != nil {
						return
					}
				}
			}()
			wait = func() error { <-done; return digestErr }
		}
		var announce func() error
		if notify {
			announce = func() error {
				if err := wait(); err != nil {
					return err
				}
				return g.notify(s, res.ID, vcfg.Mode, len(descs), base, chunk, digests)
			}
		}
		err := g.deliver(s, vcfg, seed, chunk, base, &res, announce)
		if werr := wait(); err == nil { // never return while the digest goroutine still reads the sources
			err = werr
		}
		if err != nil {
			return res, fmt.Errorf("session %s: %w", name, err)
		}
		if opts.Digests != nil {
			copy(opts.Digests[base:], digests)
		}
	}
	g.stats.descriptors.Add(int64(len(descs)))
	g.stats.bytes.Add(int64(total))
	return res, nil
}

// deliver writes one chunk and checks it as vcfg says: read-back modes
// read after a fence (pipelined with the first read, so one round trip)
// and may re-send what never matched; digest mode fences and leaves the
// comparison to the receiver; off trusts the transport. announce, if not
// nil, sends the chunk's notice: after the check, or in digest mode while
// the fence is in flight (the receiver's sync waits for writes anyway).
func (g *Guard) deliver(s *session, vcfg verify.Config, seed uint64, chunk []verify.Desc, base int, res *TransferResult, announce func() error) error {
	if err := s.conn.write(g.ctx, chunk, base, g.regions); err != nil {
		s.disconnect()
		return err
	}
	if announce == nil {
		announce = func() error { return nil }
	}
	switch {
	case vcfg.Mode == verify.Off:
		return announce()
	case !vcfg.Mode.ReadsBack():
		fenced := make(chan error, 1)
		go func() { fenced <- s.conn.fence(g.ctx) }()
		notified := announce()
		if err := <-fenced; err != nil {
			s.disconnect()
			return err
		}
		return notified
	}
	// index maps positions in the descriptors being checked to the batch.
	todo, index := chunk, make([]int, len(chunk))
	for i := range index {
		index[i] = base + i
	}
	for attempt := 0; ; attempt++ {
		fenced := false
		read := func(ctx context.Context, ranges []verify.Range, out []byte) error {
			first := !fenced
			fenced = true
			return s.conn.read(ctx, ranges, out, first)
		}
		local := g.regions.View
		vr, err := verify.Check(g.ctx, vcfg, seed, todo, local, read, &s.scratch)
		res.Retries += vr.Retries
		g.stats.retries.Add(int64(vr.Retries))
		g.stats.probed.Add(vr.Probed)
		var me *verify.MismatchError
		if !errors.As(err, &me) {
			if err != nil {
				s.disconnect()
				return err
			}
			return announce()
		}
		bad, badIndex := make([]verify.Desc, len(me.Descs)), make([]int, len(me.Descs))
		for i, k := range me.Descs {
			bad[i], badIndex[i] = todo[k], index[k]
		}
		me.Descs = badIndex
		if vcfg.OnMismatch != verify.Resend || attempt >= vcfg.MaxResends {
			if attempt > 0 {
				me.Where = fmt.Sprintf("still differ at the target after %d re-sends", attempt)
			}
			return me
		}
		res.Resends++
		g.stats.resends.Add(1)
		todo, index = bad, badIndex
		if err := s.conn.write(g.ctx, todo, 0, g.regions); err != nil {
			s.disconnect()
			return err
		}
	}
}

// notify sends one chunk's completion notice to the session's guard and
// waits for it to be recorded there.
func (g *Guard) notify(s *session, id uint64, mode verify.Mode, total, base int, chunk []verify.Desc, digests []uint64) error {
	for off := 0; off < len(chunk); off += wire.MaxNoticeDescs {
		part := chunk[off:min(off+wire.MaxNoticeDescs, len(chunk))]
		n := wire.Notice{Token: s.hello.Token, ID: id, Mode: modeIndex(mode), Total: total, Base: base + off, Descs: make([]wire.NoticeDesc, len(part))}
		for i, d := range part {
			n.Descs[i] = wire.NoticeDesc{Dst: d.Dst, Len: d.Len}
			if digests != nil {
				n.Descs[i].Digest = digests[off+i]
			}
		}
		if err := s.notify(g.ctx, g.zctx, &g.cfg, wire.EncodeNotice(nil, n)); err != nil {
			return err
		}
		g.stats.noticesSent.Add(1)
	}
	return nil
}

func modeIndex(m verify.Mode) uint8 {
	for i, x := range verify.Modes {
		if x == m {
			return uint8(i)
		}
	}
	return 0
}

// answerHandshake answers one handshake step: a hello gets the data
// endpoint and a fresh token, or a challenge if this guard has a secret;
// an auth gets the endpoint and the guard's own proof.
func (g *Guard) answerHandshake(body []byte) helloReply {
	refuse := func(format string, args ...any) helloReply {
		msg := fmt.Sprintf(format, args...)
		log.Printf("mcguard: %s: refused a handshake: %s", g.Endpoint(), msg)
		return helloReply{Proto: ProtocolVersion, Error: msg}
	}
	var req helloRequest
	if err := decodeStrict(body, &req); err != nil {
		return refuse("malformed control request: %v", err)
	}
	if req.Proto != ProtocolVersion {
		return refuse("protocol version %d, this guard speaks %d", req.Proto, ProtocolVersion)
	}
	if len(req.Nonce) != nonceSize {
		return refuse("a %d-byte nonce, want %d", len(req.Nonce), nonceSize)
	}
	rep := helloReply{Proto: ProtocolVersion, Data: g.target.addr()}
	switch {
	case req.Op == "hello" && g.auth.secret != nil:
		return helloReply{Proto: ProtocolVersion, Challenge: g.auth.challenge()}
	case req.Op == "hello":
		rep.Token = randomBytes(wire.TokenSize)
		g.auth.tokens.add(rep.Token, req.Sender)
	case req.Op == "auth" && g.auth.secret != nil:
		proof, _, err := g.auth.answer(req)
		if err != nil {
			return refuse("%v", err)
		}
		rep.MAC = proof
	default:
		return refuse("unexpected control op %q", req.Op)
	}
	rep.Regions = g.regions.Snapshot()
	if g.rdma != nil {
		if len(req.RDMA) > MaxRDMAQPs {
			return refuse("%d queue pairs asked for, at most %d", len(req.RDMA), MaxRDMAQPs)
		}
		if len(req.RDMA) > 0 {
			infos, err := g.rdma.accept(string(req.Sender), req.RDMA)
			if err != nil {
				return refuse("cannot connect queue pairs to the peer's: %v", err)
			}
			rep.RDMA = infos
		}
		rep.RKeys = g.rdma.rkeys(rep.Regions)
		rep.RDMAFlush = g.rdma.ep.Flush()
	} else if len(req.RDMA) > 0 {
		return refuse("this guard's transport is tcp, not rdma")
	}
	return rep
}

// receiveNotice records a peer's notice; the reply says whether it was
// taken. A notice that is malformed or names memory this guard did not
// register is refused whole.
func (g *Guard) receiveNotice(body []byte) []byte {
	rep := controlReply{Proto: ProtocolVersion}
	n, err := wire.DecodeNotice(body, len(verify.Modes))
	if err == nil && !g.auth.tokens.has(n.Token) {
		err = fmt.Errorf("the notice's token belongs to no handshake with this guard")
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
		err = g.notices.add(n)
	}
	if err != nil {
		rep.Error = err.Error()
	} else {
		g.stats.noticesReceived.Add(1)
	}
	out, _ := json.Marshal(rep)
	return out
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
		if err := s.conn.read(g.ctx, ranges, buf, false); err != nil {
			s.disconnect()
			return fmt.Errorf("session %s: %w", name, err)
		}
		for _, p := range group {
			if err := g.regions.Store(p.local, p.n, func(m []byte) error { copy(m, buf[:p.n]); return nil }); err != nil {
				return err
			}
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
		s = &session{name: name, sender: randomBytes(nonceSize)}
		g.sessions[name] = s
	}
	return s
}

// SyncRange is one destination range the receiver was told is complete.
type SyncRange struct{ Addr, Len uint64 }

// Sync is the receiver's half for ranges the application was told about
// (the vLLM connector's own OK message): it waits until writes still in
// flight to them have landed, makes them safe to read (the device hook: a
// full fence for host memory) and, when digests are given (one per range,
// as the sender's mc_guard_transfer returned them), compares them.
func (g *Guard) Sync(ranges []SyncRange, digests []uint64, stream uint64) error {
	if err := g.enter(); err != nil {
		return err
	}
	defer g.inflight.Done()
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
	return g.settle(ctx, ranges, digests, "range", stream)
}

// SyncTransfers is the receiver's half for transfers announced by
// completion notices: it waits (up to sync_timeout) for each transfer's
// notice, then settles its ranges as Sync does, comparing digests when the
// transfer was sent in digest mode.
func (g *Guard) SyncTransfers(ids []uint64, stream uint64) error {
	if err := g.enter(); err != nil {
		return err
	}
	defer g.inflight.Done()
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
		if err := g.settle(ctx, ranges, digests, fmt.Sprintf("transfer %#x descriptor", id), stream); err != nil {
			return err
		}
	}
	return nil
}

// settle waits for writes in flight to ranges, runs the device hook (for
// each GPU the ranges are on: flush GPUDirect writes, then synchronise the
// caller's stream or the context), and compares digests if there are any.
func (g *Guard) settle(ctx context.Context, ranges []SyncRange, digests []uint64, what string, stream uint64) error {
	g.stats.syncs.Add(1)
	regions := make([]Region, len(ranges))
	for i, r := range ranges {
		regions[i] = Region(r)
	}
	if err := g.target.held.wait(ctx, regions); err != nil {
		g.stats.syncFailures.Add(1)
		return fmt.Errorf("%w: writes to the synced ranges were still in flight after %v", ErrTimeout, g.cfg.SyncTimeout)
	}
	// Host memory needs no hook: the target applied its writes before it
	// acknowledged them, and the application learned of the transfer
	// through a message (a syscall), which orders memory. GPU memory does:
	for _, ordinal := range g.regions.devices(regions) {
		if err := g.regions.gpu.Settle(ordinal, stream); err != nil {
			g.stats.syncFailures.Add(1)
			return fmt.Errorf("%w: GPU %d: %v", ErrDevice, ordinal, err)
		}
	}
	if digests == nil {
		return nil
	}
	ok := digestRanges(g.regions, ranges, digests)
	var bad []string
	for i, r := range ranges {
		if !ok[i] {
			if len(bad) < 16 {
				bad = append(bad, fmt.Sprintf("%s %d [%#x, +%d)", what, i, r.Addr, r.Len))
			} else if len(bad) == 16 {
				bad = append(bad, "...")
			}
		}
	}
	if bad != nil {
		g.stats.syncFailures.Add(1)
		return fmt.Errorf("%w: destination digests differ from the sender's: %s", ErrVerify, strings.Join(bad, ", "))
	}
	return nil
}

// digestRanges compares each range's digest with want, spreading large
// work over the CPUs: the bytes just arrived from the network and are read
// from memory, not cache, so one core alone is bound by memory latency.
func digestRanges(regions *Regions, ranges []SyncRange, want []uint64) []bool {
	ok := make([]bool, len(ranges))
	check := func(i int) {
		r := ranges[i]
		d, err := regions.Digest(r.Addr, r.Len)
		ok[i] = err == nil && d == want[i]
	}
	var total uint64
	for _, r := range ranges {
		total += r.Len
	}
	workers := min(runtime.GOMAXPROCS(0), len(ranges))
	if total < 4<<20 || workers < 2 {
		for i := range ranges {
			check(i)
		}
		return ok
	}
	var next atomic.Int64
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := int(next.Add(1)) - 1; i < len(ranges); i = int(next.Add(1)) - 1 {
				check(i)
			}
		}()
	}
	wg.Wait()
	return ok
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
		"endpoint":         g.Endpoint(),
		"data_endpoint":    g.target.addr(),
		"verify":           g.cfg.Verify.Mode,
		"inject":           g.cfg.Inject.Mode,
		"transport":        g.transportName(),
		"max_batch":        g.cfg.MaxBatch,
		"sessions":         nsessions,
		"regions":          len(g.regions.Snapshot()),
		"transfers":        g.stats.transfers.Load(),
		"ok":               g.stats.ok.Load(),
		"failed":           g.stats.failed.Load(),
		"descriptors":      g.stats.descriptors.Load(),
		"bytes":            g.stats.bytes.Load(),
		"retries":          g.stats.retries.Load(),
		"resends":          g.stats.resends.Load(),
		"notices_sent":     g.stats.noticesSent.Load(),
		"notices_received": g.stats.noticesReceived.Load(),
		"syncs":            g.stats.syncs.Load(),
		"sync_failures":    g.stats.syncFailures.Load(),
		"notify":           g.cfg.Notify,
		"cuda":             g.cudaState,
		"rdma":             g.rdmaState,
		"rdma_qps":         g.cfg.RDMAQPs,
		"verify_failures":  g.stats.verifyFailures.Load(),
		"probed_bytes":     g.stats.probed.Load(),
	})
}
