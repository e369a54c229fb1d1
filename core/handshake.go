package core

import (
	"context"
	"crypto/hmac"
	"encoding/json"
	"fmt"
	"net"
	"strings"
	"time"

	zmq "github.com/pebbe/zmq4"

	"github.com/mcguard/mcguard/core/auth"
	"github.com/mcguard/mcguard/core/control"
	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/core/logs"
	"github.com/mcguard/mcguard/core/memory"
	"github.com/mcguard/mcguard/core/transport"
	"github.com/mcguard/mcguard/core/wire"
)

// The handshake, both halves: a sender's request for a session's region
// table, token and data-plane answer (handshake), and a guard's answer to
// it (answerHandshake). The control channel it travels on is control.go;
// authentication is auth.go.

// ProtocolVersion is spoken in the handshake; a peer with another is refused.
// Version 2 added authentication and tokens in notices; 3, a list of queue
// pairs (one per RDMA stripe) where 2 had one; 4 carries the data plane's
// part of the handshake as an offer and an answer that only that data
// plane reads.
const ProtocolVersion = 4

// helloRequest is a handshake step: "hello", then "auth" if the guard
// asked for it.
type helloRequest struct {
	Proto     int    `json:"proto"`
	Op        string `json:"op"`
	Nonce     []byte `json:"nonce,omitempty"`     // the peer's fresh nonce
	Challenge []byte `json:"challenge,omitempty"` // auth: the guard's challenge it answers
	MAC       []byte `json:"mac,omitempty"`       // auth: its proof
	// Sender names the sending session across reconnects, so the target
	// can drop its older data connections (and their late bytes).
	Sender []byte `json:"sender,omitempty"`
	// Transport names the data plane the sender sends over, and Offer is
	// that data plane's part of the request (its queue pairs, say).
	Transport string          `json:"transport,omitempty"`
	Offer     json.RawMessage `json:"offer,omitempty"`
	// An "abort" names its handshake by Token, with a sequence number
	// above the last one used under it, and MAC under the handshake's key.
	Token []byte `json:"token,omitempty"`
	Seq   uint64 `json:"seq,omitempty"`
	// A "notify" (authenticated as an abort is) carries an application
	// message for the receiver's Notifies.
	Name string `json:"name,omitempty"`
	Msg  string `json:"msg,omitempty"`
}

// helloReply tells a sender what it may write to and how its data plane
// reaches the target, or, from a guard with a secret, the challenge to
// answer first.
type helloReply struct {
	Proto     int             `json:"proto"`
	Error     string          `json:"error,omitempty"`
	Challenge []byte          `json:"challenge,omitempty"` // authenticate first
	Token     []byte          `json:"token,omitempty"`     // unauthenticated guards: binds data connections to this handshake
	MAC       []byte          `json:"mac,omitempty"`       // authenticated guards: their proof
	Regions   []memory.Region `json:"regions,omitempty"`
	// Answer is the data plane's part of the reply (the target's address,
	// its queue pairs and rkeys, ...).
	Answer json.RawMessage `json:"answer,omitempty"`
	// host is the address the sender reached the guard at, and key the
	// handshake's key (neither is sent).
	host string
	key  []byte
}

// controlReply is the answer to a notice, or to a request that failed.
type controlReply struct {
	Proto int    `json:"proto"`
	Error string `json:"error,omitempty"`
	Code  string `json:"code,omitempty"` // codeUnknownToken, or empty
}

// codeUnknownToken: the notice's token belongs to no handshake the guard
// still keeps; the sender may shake hands again.
const codeUnknownToken = "unknown_token"

// handshake asks the guard at session for its region table, a token and
// its data plane's answer to req's offer, authenticating both ways when
// secret is set. req gives Sender, Transport and Offer; handshake fills in
// the rest. The REQ socket lives only for this call and this goroutine.
func handshake(ctx context.Context, zctx *zmq.Context, session string, timeout time.Duration, secret []byte, req helloRequest) (helloReply, error) {
	sock, addr, err := control.NewReqSocket(ctx, zctx, session, timeout)
	if err != nil {
		return helloReply{}, err
	}
	defer sock.Close()
	nonce := auth.RandomBytes(auth.NonceSize)
	req.Proto, req.Op, req.Nonce = ProtocolVersion, "hello", nonce
	rep, err := handshakeStep(ctx, sock, session, timeout, req)
	if err != nil {
		return helloReply{}, err
	}
	switch {
	case rep.Challenge != nil && secret == nil:
		return helloReply{}, fmt.Errorf("%w: session %q requires authentication: configure the shared secret (secret, secret_file or MC_GUARD_SECRET)", errs.Session, session)
	case rep.Challenge == nil && secret != nil:
		return helloReply{}, fmt.Errorf("%w: session %q did not authenticate itself (it has no secret); refusing an unauthenticated peer", errs.Session, session)
	case rep.Challenge != nil:
		challenge := rep.Challenge
		req.Op, req.Challenge, req.MAC = "auth", challenge, auth.MAC(secret, auth.LabelClient, challenge, nonce)
		if rep, err = handshakeStep(ctx, sock, session, timeout, req); err != nil {
			return helloReply{}, err
		}
		if !hmac.Equal(rep.MAC, auth.MAC(secret, auth.LabelServer, nonce, challenge)) {
			return helloReply{}, fmt.Errorf("%w: session %q failed to prove it knows the shared secret", errs.Session, session)
		}
		rep.Token, rep.key = auth.DeriveToken(secret, challenge, nonce), auth.DeriveKey(secret, challenge, nonce)
	default:
		rep.key = rep.Token // no secret: nothing to keep from an observer
	}
	if len(rep.Answer) == 0 || len(rep.Token) != wire.TokenSize {
		return helloReply{}, fmt.Errorf("%w: session %q sent an incomplete handshake reply", errs.Session, session)
	}
	rep.host, _, _ = net.SplitHostPort(addr)
	return rep, nil
}

func handshakeStep(ctx context.Context, sock *zmq.Socket, session string, timeout time.Duration, req helloRequest) (helloReply, error) {
	body, _ := json.Marshal(req)
	raw, err := control.Request(ctx, sock, session, "handshake", body, timeout)
	if err != nil {
		return helloReply{}, err
	}
	var rep helloReply
	if err := control.DecodeStrict(raw, &rep); err != nil {
		return helloReply{}, fmt.Errorf("%w: session %q sent a malformed handshake reply: %v", errs.Session, session, err)
	}
	if rep.Error != "" {
		return helloReply{}, fmt.Errorf("%w: session %q refused the handshake: %s", errs.Session, session, rep.Error)
	}
	if rep.Proto != ProtocolVersion {
		return helloReply{}, fmt.Errorf("%w: session %q speaks protocol version %d, this guard %d", errs.Session, session, rep.Proto, ProtocolVersion)
	}
	return rep, nil
}

// answerHandshake answers one handshake step: a hello gets the region
// table, a fresh token and the data plane's answer, or a challenge if this
// guard has a secret; an auth gets the same with the guard's own proof.
// peer names the control connection the step came on.
func (g *Guard) answerHandshake(peer, body []byte) []byte {
	out, _ := json.Marshal(g.answer(peer, body))
	return out
}

func (g *Guard) answer(peer, body []byte) helloReply {
	refuse := func(format string, args ...any) helloReply {
		g.metrics.handshakes.Add(1, "refused")
		msg := fmt.Sprintf(format, args...)
		logs.Printf(logs.Info, "%s: refused a handshake: %s", g.Endpoint(), msg)
		return helloReply{Proto: ProtocolVersion, Error: msg}
	}
	var req helloRequest
	if err := control.DecodeStrict(body, &req); err != nil {
		return refuse("malformed control request: %v", err)
	}
	if req.Proto != ProtocolVersion {
		return refuse("protocol version %d, this guard speaks %d", req.Proto, ProtocolVersion)
	}
	if len(req.Nonce) != auth.NonceSize {
		return refuse("a %d-byte nonce, want %d", len(req.Nonce), auth.NonceSize)
	}
	plane := g.plane(req.Transport)
	if plane == nil {
		return refuse("this guard does not serve transport %q (it serves %s)", req.Transport, g.planeNames())
	}
	if req.Op == "abort" {
		if err := g.answerAbort(req); err != nil {
			return refuse("abort: %v", err)
		}
		return helloReply{Proto: ProtocolVersion}
	}
	if req.Op == "notify" {
		if err := g.answerNotify(req); err != nil {
			return refuse("notify: %v", err)
		}
		return helloReply{Proto: ProtocolVersion}
	}
	rep := helloReply{Proto: ProtocolVersion}
	var token, key []byte
	switch {
	case req.Op == "hello" && g.auth.Authenticates():
		g.metrics.handshakes.Add(1, "challenged")
		return helloReply{Proto: ProtocolVersion, Challenge: g.auth.Challenge(peer)}
	case req.Op == "hello":
		token = g.auth.Open(req.Sender)
		key = token
		rep.Token = token
	case req.Op == "auth" && g.auth.Authenticates():
		proof, tok, k, err := g.auth.Answer(peer, auth.Proof{Challenge: req.Challenge, Nonce: req.Nonce, MAC: req.MAC, Sender: req.Sender})
		if err != nil {
			g.metrics.authFailures.Add(1)
			return refuse("%v", err)
		}
		rep.MAC, token, key = proof, tok, k
	default:
		return refuse("unexpected control op %q", req.Op)
	}
	rep.Regions = g.regions.Snapshot()
	answer, err := plane.Accept(transport.Peer{Sender: string(req.Sender), Token: token, Key: key}, req.Offer, rep.Regions)
	if err != nil {
		return refuse("%s: %v", plane.Name(), err)
	}
	rep.Answer = answer
	g.metrics.handshakes.Add(1, "ok")
	return rep
}

// planeNames lists the data planes this guard serves.
func (g *Guard) planeNames() string {
	names := make([]string, len(g.planes))
	for i, p := range g.planes {
		names[i] = p.Name()
	}
	return strings.Join(names, ", ")
}
