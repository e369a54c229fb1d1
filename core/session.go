package core

import (
	"context"
	"fmt"
	"sync"

	zmq "github.com/pebbe/zmq4"

	"github.com/mcguard/mcguard/core/auth"
	"github.com/mcguard/mcguard/core/control"
	"github.com/mcguard/mcguard/core/desc"
	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/core/logs"
	"github.com/mcguard/mcguard/core/memory"
	"github.com/mcguard/mcguard/core/reuse"
	"github.com/mcguard/mcguard/core/transport"
	"github.com/mcguard/mcguard/core/transport/tcp"
	"github.com/mcguard/mcguard/core/wire"
	"github.com/mcguard/mcguard/verify"
)

// session is one remote guard, named "host:port" by its control endpoint.
// Its lock is held for a whole batch, so batches to one session never
// interleave, while batches to different sessions run in parallel.
type session struct {
	name   string
	sender []byte // this session's id at the peer, kept across reconnects
	mu     sync.Mutex
	// control is the peer guard's endpoint, for handshakes and notices:
	// the session's name, except over an engine, where the name is the
	// engine's and the peer's guard (if any) is set with SetPeerGuard.
	control string

	cmu sync.Mutex // gen: the transfers in flight, to cancel (not under mu: they may wait for it)
	gen *callGen

	// Under mu:
	hello   control.HelloReply
	conn    transport.Conn // nil until connected, and again after an I/O error
	seq     uint64         // of the last notice sent under hello.Token
	notices *zmq.Socket    // REQ to the peer's control endpoint, for notices
	scratch verify.Scratch
	sendBufs
}

// sendBufs are a session's buffers for digest mode's digests and notices,
// reused by every transfer under the session's lock (none keeps them past
// its return), so that a steady stream of transfers allocates nothing.
type sendBufs struct {
	digests     []uint64
	noticeDescs []wire.NoticeDesc
	noticeBody  []byte
	digestJob   digestJob     // a chunk's digests taken beside its writes
	held        []memory.Held // the transfer's source regions (holdSources)
}

// connect makes sure the session has a handshake and a data connection
// over the guard's data plane.
func (s *session) connect(ctx context.Context, g *Guard) error {
	if s.conn != nil {
		return nil
	}
	if g.engine != nil {
		s.conn = s.engineConn(ctx, g)
		return nil
	}
	rep, conn, err := s.dial(ctx, g, g.data, s.name)
	if err != nil {
		return err
	}
	s.hello, s.conn, s.seq = rep, conn, 0
	return nil
}

// engineConn is the session's connection over the engine. The engine
// knows its peers: the handshake with the peer's guard waits until a
// notice needs it (greet); except where that guard is known and
// engine_peer_checks is on (the default), where the session connects to
// it over TCP (or the same-host path) at once, for the read-backs and
// notices (engine.Plane.ConnChecked). A guard that cannot be reached so
// leaves them to the engine, said once.
func (s *session) engineConn(ctx context.Context, g *Guard) transport.Conn {
	if s.control == "" || !g.cfg.Planes.Engine.PeerChecks {
		return g.engine.Conn(s.name)
	}
	rep, peer, err := s.dial(ctx, g, g.plane(tcp.Name), s.control)
	if err != nil {
		peerChecksFallback.Printf(logs.Info, "session %s: read-backs go through the %s engine, as its peer's guard at %s could not be reached over mcguard's own connection: %v",
			s.name, g.engine.Engine(), s.control, err)
		g.stats.peerCheckFallbacks.Add(1)
		return g.engine.Conn(s.name)
	}
	s.hello, s.seq = rep, 0
	g.stats.peerChecked.Add(1)
	return g.engine.ConnChecked(s.name, peer)
}

var peerChecksFallback logs.Once

// checked is the session's connection as verification uses it: its own,
// or the view whose read-backs go to the peer's guard (Caps.Checks).
func (s *session) checked() transport.Conn {
	if c := s.conn.Caps().Checks; c != nil {
		return c
	}
	return s.conn
}

// dial shakes hands with the guard at endpoint and connects to it over
// plane.
func (s *session) dial(ctx context.Context, g *Guard, plane transport.Transport, endpoint string) (control.HelloReply, transport.Conn, error) {
	d, err := plane.Dial()
	if err != nil {
		return control.HelloReply{}, nil, err
	}
	rep, err := control.Handshake(ctx, g.zctx, endpoint, g.cfg.ConnectTimeout, g.cfg.Secret, control.Hello{Sender: s.sender, Transport: plane.Name(), Offer: d.Offer()})
	if err != nil {
		d.Abandon()
		return control.HelloReply{}, nil, err
	}
	conn, err := d.Connect(ctx, transport.Peer{Sender: string(s.sender), Token: rep.Token, Key: rep.Key, Host: rep.Host}, rep.Answer, rep.Regions)
	return rep, conn, err
}

// refresh fetches the region table again, for a destination that the last
// handshake did not list (the receiver may have registered more since).
func (s *session) refresh(ctx context.Context, g *Guard) error {
	if s.control == "" {
		return fmt.Errorf("%w: session %s is reached through the %s engine, and this guard does not know where its peer's guard listens (mc_guard_set_peer_guard): completion notices, notifies and the peer's region table need it; without one, use a read-back mode, or notify \"never\" and forward the digests to the receiver's mc_guard_sync yourself", errs.Config, s.name, g.engine.Engine())
	}
	rep, err := control.Handshake(ctx, g.zctx, s.control, g.cfg.ConnectTimeout, g.cfg.Secret, control.Hello{Sender: s.sender, Transport: g.handshakeTransport()})
	if err != nil {
		return err
	}
	if s.conn != nil {
		if err := s.conn.Refresh(rep.Answer, rep.Regions); err != nil {
			return err
		}
	}
	// The newest token: the receiver keeps only a few per sender.
	s.hello.Regions, s.hello.Token, s.hello.Key, s.hello.Guard, s.seq = rep.Regions, rep.Token, rep.Key, rep.Guard, 0
	return nil
}

// greet makes sure the session has a handshake with the peer's guard, for
// its control channel: connect made one, except over an engine.
func (s *session) greet(ctx context.Context, g *Guard) error {
	if len(s.hello.Token) > 0 {
		return nil
	}
	return s.refresh(ctx, g)
}

// errUnknownToken: the peer no longer knows this session's handshake.
var errUnknownToken = transport.ErrStaleToken

// disconnect drops the data connection and the notice socket; the next
// batch reconnects.
func (s *session) disconnect() {
	if s.conn != nil {
		s.conn.Close()
		s.conn = nil
	}
	if s.notices != nil {
		s.notices.Close()
		s.notices = nil
	}
}

// notify sends one notice and waits until the peer recorded it. The
// socket belongs to the session and is used only under its lock, so one
// goroutine at a time touches it (the lock hand-off is the memory barrier
// ZeroMQ asks for when a socket changes threads).
func (s *session) notify(ctx context.Context, zctx *zmq.Context, cfg *Config, body []byte) error {
	if s.notices == nil {
		sock, _, err := control.NewReqSocket(ctx, zctx, s.control, cfg.ConnectTimeout)
		if err != nil {
			return err
		}
		s.notices = sock
	}
	raw, err := control.Request(ctx, s.notices, s.control, "completion notice", body, cfg.Timeout)
	if err != nil {
		s.notices.Close() // a REQ that missed its reply cannot be reused
		s.notices = nil
		return err
	}
	var rep control.Reply
	if err := control.DecodeStrict(raw, &rep); err != nil {
		return fmt.Errorf("%w: session %q answered a notice with: %v", errs.Peer, s.name, err)
	}
	if rep.Error != "" {
		err := fmt.Errorf("%w: session %q refused the completion notice: %s", errs.Session, s.name, rep.Error)
		if rep.Code == control.CodeUnknownToken {
			err = fmt.Errorf("%w (%w)", err, errUnknownToken)
		}
		return err
	}
	return nil
}

// signNotice encodes n under the session's handshake: its token, the next
// sequence number, and the MAC under its key. The body is the session's
// buffer: valid until the next call.
func (s *session) signNotice(n wire.Notice) []byte {
	s.seq++
	n.Token, n.Seq, n.MAC = s.hello.Token, s.seq, nil
	body := wire.EncodeNotice(reuse.Keep(s.noticeBody), n)
	m := auth.NoticeMAC(s.hello.Key, body)
	copy(body[wire.NoticeMACOffset:], m[:])
	s.noticeBody = body
	return body
}

// checkDst returns the index of the first descriptor whose destination
// is outside the session's registered regions, or -1.
func (s *session) checkDst(descs []desc.Desc) int {
	for i, d := range descs {
		if !memory.Covers(s.hello.Regions, d.Dst, d.Len) {
			return i
		}
	}
	return -1
}

// noCaps is what a session without a connection can do: nothing.
var noCaps transport.Caps

// caps is the session's connection's capability set (none while it has
// no connection: a failure dropped it).
func (s *session) caps() *transport.Caps {
	if s.conn == nil {
		return &noCaps
	}
	return s.conn.Caps()
}
