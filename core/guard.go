package core

import (
	"context"
	"fmt"
	"net"
	"sync"
	"sync/atomic"

	zmq "github.com/pebbe/zmq4"

	"github.com/mcguard/mcguard/core/auth"
	"github.com/mcguard/mcguard/core/control"
	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/core/fault"
	"github.com/mcguard/mcguard/core/memory"
	"github.com/mcguard/mcguard/core/notices"
	"github.com/mcguard/mcguard/core/seal"
	"github.com/mcguard/mcguard/core/transport"
	"github.com/mcguard/mcguard/core/transport/samehost"
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
	regions *memory.Regions
	view    verify.LocalFunc // regions.View: where verification reads local bytes
	zctx    *zmq.Context
	control *control.Server

	// planes are the data planes this guard serves; data is the one it
	// sends over. planeState says, for each data plane a guard can have,
	// what it runs on or why it is not open (for stats).
	planes []transport.Transport
	// takeRingNotices takes the notices same-host senders left in TCP's
	// notice rings; false: there are none (nil before TCP opens).
	takeRingNotices func() bool
	data            transport.Transport
	planeState      map[string]string
	// engine is data when the application's engine moves the bytes
	// (OpenWithEngine); openEngine opens it, where one was handed over.
	engine     enginePlane
	openEngine func(g *Guard) (enginePlane, error)

	ctx    context.Context // cancelled by Close: aborts every wait
	cancel context.CancelFunc

	mu       sync.Mutex
	closed   bool
	sessions map[string]*session
	inflight sync.WaitGroup
	allocs   map[uint64]*samehost.SharedFile // Alloc's, by address

	notices   *notices.Store
	notifies  notifyQueue
	auth      *auth.Authority
	cudaState string            // for stats: why device memory does or does not work
	ids       *transferIDs      // transfer ids, unpredictable to peers
	id        [seal.IDSize]byte // this guard, as its seals and handshakes name it
	seals     atomic.Uint64     // the serial of its last seal
	published seal.Store        // seals readers fetch by name (Publish)
	// afterChunk, set by tests only, runs after each chunk of a transfer
	// is delivered (base: its first descriptor).
	afterChunk func(base int)
	stats      counters
	metrics    *guardMetrics
	digesters  digesters
}

// Open starts a guard: its data planes and its control endpoint.
func Open(cfg Config) (*Guard, error) {
	return open(cfg, nil)
}

// open starts a guard; ops is the application's engine, or nil.
func open(cfg Config, openEngine func(g *Guard) (enginePlane, error)) (*Guard, error) {
	host, _, err := net.SplitHostPort(cfg.Listen)
	if err != nil {
		return nil, fmt.Errorf("%w: listen %q: %v", errs.Config, cfg.Listen, err)
	}
	if cfg.Verify.SliceBytes == verify.SliceAuto {
		cfg.Verify.SliceBytes = 0 // own data planes move a descriptor in order
	}
	g := &Guard{cfg: cfg, sessions: map[string]*session{}, allocs: map[uint64]*samehost.SharedFile{}, notices: notices.NewStore(), auth: auth.NewAuthority(cfg.Secret),
		planeState: map[string]string{}, openEngine: openEngine}
	if cfg.Inject.Mode == fault.Lie && openEngine == nil {
		return nil, fmt.Errorf("%w: inject lie is an engine's fault (its reads answered from its own copy): it needs a guard over an engine", errs.Config)
	}
	g.ids = newTransferIDs()
	copy(g.id[:], auth.RandomBytes(seal.IDSize))
	g.digesters.jobs = make(chan *digestJob)
	g.metrics = newGuardMetrics(g)
	if err := g.loadCUDA(); err != nil {
		return nil, err
	}
	if err := g.openDataPlanes(host); err != nil {
		return nil, err
	}
	g.ctx, g.cancel = context.WithCancel(context.Background())
	if g.zctx, err = zmq.NewContext(); err != nil {
		g.closeDataPlanes()
		return nil, fmt.Errorf("%w: zmq context: %v", errs.Config, err)
	}
	handle := func(peer, body []byte) []byte {
		if wire.IsNotice(body) {
			return g.receiveNotice(body)
		}
		return g.answerHandshake(peer, body)
	}
	if g.control, err = control.NewServer(g.zctx, cfg.Listen, handle); err != nil {
		g.closeDataPlanes()
		g.zctx.Term()
		return nil, err
	}
	return g, nil
}

// Endpoint is the "host:port" peers use as this guard's session name.
func (g *Guard) Endpoint() string { return g.control.Endpoint }

// Config returns the guard's settings.
func (g *Guard) Config() Config { return g.cfg }

// enter admits a call unless the guard is closed; the caller defers
// g.leave, which Close waits for.
func (g *Guard) enter() error {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.closed {
		return fmt.Errorf("%w", errs.Closed)
	}
	g.inflight.Add(1)
	return nil
}

// leave ends a call enter admitted.
func (g *Guard) leave() { g.inflight.Done() }

// enterSession is enter for a call that names a session: the name is
// checked once the call is admitted, and on error the call has left.
func (g *Guard) enterSession(name string) error {
	if err := g.enter(); err != nil {
		return err
	}
	if err := g.checkSession(name); err != nil {
		g.leave()
		return err
	}
	return nil
}

// Close stops the guard. Calls in flight on other threads return an
// error; Close waits for them before it releases anything.
func (g *Guard) Close() error {
	g.mu.Lock()
	if g.closed {
		g.mu.Unlock()
		return fmt.Errorf("%w: already closed", errs.Closed)
	}
	g.closed = true
	g.mu.Unlock()
	g.cancel()
	g.inflight.Wait()
	for _, s := range g.sessions {
		s.disconnect()
	}
	g.control.Stop()
	g.zctx.Term() // returns once the control socket is closed
	g.control.Wait()
	g.closeDataPlanes()
	g.freeAllocs()
	return nil
}

func (g *Guard) closeDataPlanes() {
	for _, p := range g.planes {
		p.Close()
	}
}

// plane returns the data plane this guard serves under name, or nil.
func (g *Guard) plane(name string) transport.Transport {
	for _, p := range g.planes {
		if p.Name() == name {
			return p
		}
	}
	return nil
}

func (g *Guard) session(name string) *session {
	g.mu.Lock()
	defer g.mu.Unlock()
	s, ok := g.sessions[name]
	if !ok {
		s = &session{name: name, sender: auth.RandomBytes(auth.NonceSize), control: name}
		if g.engine != nil {
			s.control = "" // until SetPeerGuard names it
		}
		g.sessions[name] = s
	}
	return s
}
