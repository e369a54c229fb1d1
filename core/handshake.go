package core

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"

	"github.com/mcguard/mcguard/core/auth"
	"github.com/mcguard/mcguard/core/control"
	"github.com/mcguard/mcguard/core/logs"
	"github.com/mcguard/mcguard/core/transport"
)

// A guard's answer to a sender's handshake (answerHandshake): the region
// table, a token and the data plane's answer. The messages and the
// sender's half are core/control's; authentication is core/auth's.

// answerHandshake answers one handshake step: a hello gets the region
// table, a fresh token and the data plane's answer, or a challenge if this
// guard has a secret; an auth gets the same with the guard's own proof.
// peer names the control connection the step came on.
func (g *Guard) answerHandshake(peer, body []byte) []byte {
	out, _ := json.Marshal(g.answer(peer, body))
	return out
}

func (g *Guard) answer(peer, body []byte) control.HelloReply {
	refuse := func(format string, args ...any) control.HelloReply {
		g.metrics.handshakes.Add(1, "refused")
		msg := fmt.Sprintf(format, args...)
		logs.Printf(logs.Info, "%s: refused a handshake: %s", g.Endpoint(), msg)
		return control.HelloReply{Proto: control.ProtocolVersion, Error: msg}
	}
	var req control.Hello
	if err := control.DecodeStrict(body, &req); err != nil {
		return refuse("malformed control request: %v", err)
	}
	if req.Proto != control.ProtocolVersion {
		return refuse("protocol version %d, this guard speaks %d", req.Proto, control.ProtocolVersion)
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
		return control.HelloReply{Proto: control.ProtocolVersion}
	}
	if req.Op == "seal" {
		if sealed := g.published.Get(req.Name); sealed != nil {
			return control.HelloReply{Proto: control.ProtocolVersion, Seal: sealed}
		}
		return control.HelloReply{Proto: control.ProtocolVersion, Code: control.CodeUnpublished,
			Error: fmt.Sprintf("no seal published under %q", req.Name)}
	}
	if req.Op == "notify" {
		if err := g.answerNotify(req); err != nil {
			return refuse("notify: %v", err)
		}
		return control.HelloReply{Proto: control.ProtocolVersion}
	}
	rep := control.HelloReply{Proto: control.ProtocolVersion}
	var token, key []byte
	switch {
	case req.Op == "hello" && g.auth.Authenticates():
		g.metrics.handshakes.Add(1, "challenged")
		return control.HelloReply{Proto: control.ProtocolVersion, Challenge: g.auth.Challenge(peer)}
	case req.Op == "hello":
		token = g.auth.Open(req.Sender)
		key = token
		rep.Token = token
	case req.Op == "auth" && g.auth.Authenticates():
		proof, tok, k, err := g.auth.Answer(peer, auth.Proof{Challenge: req.Challenge, Nonce: req.Nonce, MAC: req.MAC, Sender: req.Sender})
		if err != nil {
			g.metrics.authFailures.Add(1)
			r := refuse("%v", err)
			if errors.Is(err, auth.ErrStaleChallenge) {
				r.Code = control.CodeStaleChallenge
			}
			return r
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
	rep.Answer, rep.Guard = answer, g.id[:]
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
