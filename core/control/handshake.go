package control

import (
	"context"
	"crypto/hmac"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"time"

	zmq "github.com/pebbe/zmq4"

	"github.com/mcguard/mcguard/core/auth"
	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/core/logs"
	"github.com/mcguard/mcguard/core/memory"
	"github.com/mcguard/mcguard/core/wire"
)

// The handshake's messages and its sender's half: a sender's request for
// a session's region table, token and data-plane answer, authenticated
// both ways under a shared secret. The guard's answer is core's.

// ProtocolVersion is spoken in the handshake; a peer with another is refused.
// Version 2 added authentication and tokens in notices; 3, a list of queue
// pairs (one per RDMA stripe) where 2 had one; 4 carries the data plane's
// part of the handshake as an offer and an answer that only that data
// plane reads; 5, the answering guard's identity (the producer its seals
// name).
const ProtocolVersion = 5

// Hello is a handshake step: "hello", then "auth" if the guard
// asked for it.
type Hello struct {
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
	// message for the receiver's Notifies; a "seal" asks for the seal
	// published under Name.
	Name string `json:"name,omitempty"`
	Msg  string `json:"msg,omitempty"`
}

// HelloReply tells a sender what it may write to and how its data plane
// reaches the target, or, from a guard with a secret, the challenge to
// answer first.
type HelloReply struct {
	Proto     int             `json:"proto"`
	Error     string          `json:"error,omitempty"`
	Challenge []byte          `json:"challenge,omitempty"` // authenticate first
	Token     []byte          `json:"token,omitempty"`     // unauthenticated guards: binds data connections to this handshake
	MAC       []byte          `json:"mac,omitempty"`       // authenticated guards: their proof
	Regions   []memory.Region `json:"regions,omitempty"`
	// Guard is the answering guard's identity, as its seals name it.
	Guard []byte `json:"guard,omitempty"`
	// Seal answers a "seal" request: what the guard published under its
	// name; Code is CodeUnpublished where it has none.
	Seal []byte `json:"seal,omitempty"`
	Code string `json:"code,omitempty"`
	// Answer is the data plane's part of the reply (the target's address,
	// its queue pairs and rkeys, ...).
	Answer json.RawMessage `json:"answer,omitempty"`
	// Host is the address the sender reached the guard at, and Key the
	// handshake's key (neither is sent).
	Host string `json:"-"`
	Key  []byte `json:"-"`
}

// Reply is the answer to a notice, or to a request that failed.
type Reply struct {
	Proto int    `json:"proto"`
	Error string `json:"error,omitempty"`
	Code  string `json:"code,omitempty"` // CodeUnknownToken, or empty
}

// CodeUnknownToken: the notice's token belongs to no handshake the guard
// still keeps; the sender may shake hands again.
const CodeUnknownToken = "unknown_token"

// CodeStaleChallenge: the guard keeps no challenge the answer could be to
// (auth.ErrStaleChallenge); a new hello gets a new one.
const CodeStaleChallenge = "stale_challenge"

// errStaleChallenge is a refusal with CodeStaleChallenge: Handshake
// starts over.
var errStaleChallenge = errors.New("the guard no longer kept the challenge answered")

// handshake asks the guard at session for its region table, a token and
// its data plane's answer to req's offer, authenticating both ways when
// secret is set. req gives Sender, Transport and Offer; handshake fills in
// the rest. The REQ socket lives only for this call and this goroutine.
//
// A try that gets no answer within a third of timeout starts over on a
// new connection, while timeout lasts: a guard under a flood of strangers
// shuts its oldest connections, and a request ZeroMQ lost with its
// connection is never answered (a REQ socket cannot send it again). So
// does one whose challenge the guard no longer kept when the answer came
// (the connection it was issued to replaced under ZeroMQ, or crowded out).
func Handshake(ctx context.Context, zctx *zmq.Context, session string, timeout time.Duration, secret []byte, req Hello) (HelloReply, error) {
	deadline := time.Now().Add(timeout)
	for tries := 1; ; tries++ {
		try := min(time.Until(deadline), max(timeout/3, minHandshakeTry))
		rep, err := handshakeOnce(ctx, zctx, session, try, secret, req)
		if err == nil || !errors.Is(err, errs.Timeout) && !errors.Is(err, errStaleChallenge) || ctx.Err() != nil {
			return rep, err
		}
		if time.Until(deadline) < minHandshakeTry/2 {
			if tries == 1 || !errors.Is(err, errs.Timeout) {
				return rep, err
			}
			return HelloReply{}, fmt.Errorf("%w: session %q did not answer the handshake within %v (%d tries on new connections; no guard listening there?)", errs.Timeout, session, timeout, tries)
		}
		logs.Printf(logs.Debug, "session %s: handshake try %d (%v): %v; once more on a new connection", session, tries, try, err)
	}
}

// minHandshakeTry is the least a handshake try waits for its answers.
const minHandshakeTry = 200 * time.Millisecond

// handshakeOnce is one try of Handshake, on a connection of its own.
func handshakeOnce(ctx context.Context, zctx *zmq.Context, session string, timeout time.Duration, secret []byte, req Hello) (HelloReply, error) {
	end := time.Now().Add(timeout)
	sock, addr, err := NewReqSocket(ctx, zctx, session, timeout)
	if err != nil {
		return HelloReply{}, err
	}
	defer sock.Close()
	nonce := auth.RandomBytes(auth.NonceSize)
	req.Proto, req.Op, req.Nonce = ProtocolVersion, "hello", nonce
	rep, err := HandshakeStep(ctx, sock, session, max(time.Until(end), time.Millisecond), req)
	if err != nil {
		return HelloReply{}, err
	}
	switch {
	case rep.Challenge != nil && secret == nil:
		return HelloReply{}, fmt.Errorf("%w: session %q requires authentication: configure the shared secret (secret, secret_file or MC_GUARD_SECRET)", errs.Session, session)
	case rep.Challenge == nil && secret != nil:
		return HelloReply{}, fmt.Errorf("%w: session %q did not authenticate itself (it has no secret); refusing an unauthenticated peer", errs.Session, session)
	case rep.Challenge != nil:
		challenge := rep.Challenge
		req.Op, req.Challenge, req.MAC = "auth", challenge, auth.MAC(secret, auth.LabelClient, challenge, nonce)
		if rep, err = HandshakeStep(ctx, sock, session, max(time.Until(end), time.Millisecond), req); err != nil {
			return HelloReply{}, err
		}
		if !hmac.Equal(rep.MAC, auth.MAC(secret, auth.LabelServer, nonce, challenge)) {
			return HelloReply{}, fmt.Errorf("%w: session %q failed to prove it knows the shared secret", errs.Session, session)
		}
		rep.Token, rep.Key = auth.DeriveToken(secret, challenge, nonce), auth.DeriveKey(secret, challenge, nonce)
	default:
		rep.Key = rep.Token // no secret: nothing to keep from an observer
	}
	if len(rep.Answer) == 0 || len(rep.Token) != wire.TokenSize {
		return HelloReply{}, fmt.Errorf("%w: session %q sent an incomplete handshake reply", errs.Session, session)
	}
	rep.Host, _, _ = net.SplitHostPort(addr)
	return rep, nil
}

func HandshakeStep(ctx context.Context, sock *zmq.Socket, session string, timeout time.Duration, req Hello) (HelloReply, error) {
	body, _ := json.Marshal(req)
	raw, err := Request(ctx, sock, session, "handshake", body, timeout)
	if err != nil {
		return HelloReply{}, err
	}
	var rep HelloReply
	if err := DecodeStrict(raw, &rep); err != nil {
		return HelloReply{}, fmt.Errorf("%w: session %q sent a malformed handshake reply: %v", errs.Session, session, err)
	}
	if rep.Error != "" {
		if rep.Code == CodeStaleChallenge {
			return HelloReply{}, fmt.Errorf("%w: session %q refused the handshake: %s (%w)", errs.Session, session, rep.Error, errStaleChallenge)
		}
		return HelloReply{}, fmt.Errorf("%w: session %q refused the handshake: %s", errs.Session, session, rep.Error)
	}
	if rep.Proto != ProtocolVersion {
		return HelloReply{}, fmt.Errorf("%w: session %q speaks protocol version %d, this guard %d", errs.Session, session, rep.Proto, ProtocolVersion)
	}
	return rep, nil
}

// CodeUnpublished: the guard keeps no seal under the name asked for (not
// published yet, withdrawn, or crowded out).
const CodeUnpublished = "unpublished"

// FetchSeal asks the guard at session once for the seal it published
// under name: the seal, or pending when it has none (yet).
func FetchSeal(ctx context.Context, zctx *zmq.Context, session string, timeout time.Duration, transport, name string) (seal []byte, pending bool, err error) {
	sock, _, err := NewReqSocket(ctx, zctx, session, timeout)
	if err != nil {
		return nil, false, err
	}
	defer sock.Close()
	body, _ := json.Marshal(Hello{Proto: ProtocolVersion, Op: "seal", Nonce: auth.RandomBytes(auth.NonceSize), Transport: transport, Name: name})
	raw, err := Request(ctx, sock, session, "seal", body, timeout)
	if err != nil {
		return nil, false, err
	}
	var rep HelloReply
	if err := DecodeStrict(raw, &rep); err != nil {
		return nil, false, fmt.Errorf("%w: session %q sent a malformed seal reply: %v", errs.Session, session, err)
	}
	switch {
	case rep.Code == CodeUnpublished:
		return nil, true, nil
	case rep.Error != "":
		return nil, false, fmt.Errorf("%w: session %q refused the seal request: %s", errs.Session, session, rep.Error)
	case len(rep.Seal) == 0:
		return nil, false, fmt.Errorf("%w: session %q sent an empty seal", errs.Session, session)
	}
	return rep.Seal, false, nil
}
