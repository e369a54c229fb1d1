package core

import (
	"bytes"
	"context"
	"crypto/hmac"
	"encoding/json"
	"fmt"
	"log"
	"net"
	"sync"
	"time"

	zmq "github.com/pebbe/zmq4"

	"github.com/mcguard/mcguard/core/rdma"
	"github.com/mcguard/mcguard/core/wire"
)

// ProtocolVersion is spoken in the handshake; a peer with another is refused.
// Version 2 added authentication and tokens in notices; 3, a list of queue
// pairs (one per RDMA stripe) where 2 had one.
const ProtocolVersion = 3

// maxControlMessage bounds what a control socket accepts from a peer.
const maxControlMessage = 2 << 20

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
	// RDMA is the sender's queue pairs (one per stripe), when its
	// transport is RDMA.
	RDMA []rdma.QPInfo `json:"rdma,omitempty"`
}

// helloReply tells a sender where to send data and what it may write to,
// or, from a guard with a secret, the challenge to answer first.
type helloReply struct {
	Proto     int      `json:"proto"`
	Error     string   `json:"error,omitempty"`
	Challenge []byte   `json:"challenge,omitempty"` // authenticate first
	Data      string   `json:"data,omitempty"`      // the target's TCP "host:port"
	Token     []byte   `json:"token,omitempty"`     // unauthenticated guards: binds data connections to this handshake
	MAC       []byte   `json:"mac,omitempty"`       // authenticated guards: their proof
	Regions   []Region `json:"regions,omitempty"`
	// RDMA answers a request's queue pairs: the target's, one for each of
	// the sender's, and an rkey per region (0: not reachable over RDMA).
	RDMA  []rdma.QPInfo `json:"rdma,omitempty"`
	RKeys []uint32      `json:"rkeys,omitempty"`
	// RDMAFlush: the target's regions accept the FLUSH verb.
	RDMAFlush bool `json:"rdma_flush,omitempty"`
}

// controlReply is the answer to a notice, or to a request that failed.
type controlReply struct {
	Proto int    `json:"proto"`
	Error string `json:"error,omitempty"`
}

// controlServer answers handshakes and notices on a ZMQ ROUTER socket. The
// socket has one owner, the serve goroutine; it stops when the context is
// terminated (its poll fails with ETERM), the ZeroMQ way to shut down.
// handle turns a request body into a reply body.
type controlServer struct {
	endpoint string // "host:port", the session name peers use
	done     chan struct{}
	wg       sync.WaitGroup
}

func newControlServer(zctx *zmq.Context, listen string, handle func([]byte) []byte) (*controlServer, error) {
	sock, err := zctx.NewSocket(zmq.ROUTER)
	if err != nil {
		return nil, fmt.Errorf("%w: control socket: %v", ErrConfig, err)
	}
	sock.SetLinger(0)
	sock.SetMaxmsgsize(maxControlMessage)
	host, port, _ := net.SplitHostPort(listen)
	if port == "0" {
		port = "*"
	}
	if err := sock.Bind("tcp://" + net.JoinHostPort(host, port)); err != nil {
		sock.Close()
		return nil, fmt.Errorf("%w: control channel cannot listen on %s: %v", ErrConfig, listen, err)
	}
	last, err := sock.GetLastEndpoint()
	if err != nil {
		sock.Close()
		return nil, fmt.Errorf("%w: control endpoint: %v", ErrConfig, err)
	}
	_, boundPort, _ := net.SplitHostPort(last[len("tcp://"):])
	s := &controlServer{endpoint: net.JoinHostPort(host, boundPort), done: make(chan struct{})}
	s.wg.Add(1)
	go s.serve(sock, handle)
	return s, nil
}

func (s *controlServer) serve(sock *zmq.Socket, handle func([]byte) []byte) {
	defer s.wg.Done()
	defer sock.Close()
	poller := zmq.NewPoller()
	poller.Add(sock, zmq.POLLIN)
	for {
		select {
		case <-s.done:
			return
		default:
		}
		polled, err := poller.Poll(time.Second)
		if zmq.AsErrno(err) == zmq.ETERM {
			return // the context is being terminated: Guard.Close
		}
		if err != nil || len(polled) == 0 {
			continue
		}
		msg, err := sock.RecvMessageBytes(zmq.DONTWAIT)
		// A REQ peer's message is [identity, "", body].
		if err != nil || len(msg) != 3 || len(msg[1]) != 0 {
			continue
		}
		if _, err := sock.SendMessage(msg[0], "", handle(msg[2])); err != nil {
			log.Printf("mcguard: control reply failed: %v", err)
		}
	}
}

// stop tells the serve goroutine to end; terminating the context (which
// waits for its socket to close) wakes it. wait then joins it.
func (s *controlServer) stop() { close(s.done) }
func (s *controlServer) wait() { s.wg.Wait() }

// newReqSocket opens a REQ socket to session's control endpoint.
func newReqSocket(zctx *zmq.Context, session string) (*zmq.Socket, error) {
	sock, err := zctx.NewSocket(zmq.REQ)
	if err != nil {
		return nil, fmt.Errorf("%w: control socket: %v", ErrSession, err)
	}
	sock.SetLinger(0)
	sock.SetMaxmsgsize(maxControlMessage)
	if err := sock.Connect("tcp://" + session); err != nil {
		sock.Close()
		return nil, fmt.Errorf("%w: session %q: %v", ErrSession, session, err)
	}
	return sock, nil
}

// request sends body on a REQ socket and waits for the reply until the
// timeout or ctx ends. After an error the socket must be closed: a REQ
// that missed its reply cannot be reused (Lazy Pirate).
func request(ctx context.Context, sock *zmq.Socket, session, what string, body []byte, timeout time.Duration) ([]byte, error) {
	if _, err := sock.SendBytes(body, 0); err != nil {
		return nil, fmt.Errorf("%w: session %q: %s send: %v", ErrSession, session, what, err)
	}
	deadline := time.Now().Add(timeout)
	if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
		deadline = d
	}
	poller := zmq.NewPoller()
	poller.Add(sock, zmq.POLLIN)
	for {
		left := time.Until(deadline)
		if left <= 0 {
			return nil, fmt.Errorf("%w: session %q did not answer the %s within %v (no guard listening there?)", ErrTimeout, session, what, timeout)
		}
		polled, err := poller.Poll(min(left, 50*time.Millisecond))
		if err != nil {
			return nil, fmt.Errorf("%w: session %q: %v", ErrSession, session, err)
		}
		if ctx.Err() != nil {
			return nil, fmt.Errorf("%w: %s with %q: %v", ErrClosed, what, session, ctx.Err())
		}
		if len(polled) > 0 {
			break
		}
	}
	raw, err := sock.RecvBytes(0)
	if err != nil {
		return nil, fmt.Errorf("%w: session %q: %s receive: %v", ErrSession, session, what, err)
	}
	return raw, nil
}

// handshake asks the guard at session for its data endpoint, region table
// and token, authenticating both ways when secret is set. The REQ socket
// lives only for this call and this goroutine.
func handshake(ctx context.Context, zctx *zmq.Context, session string, timeout time.Duration, secret, sender []byte, qps []rdma.QPInfo) (helloReply, error) {
	sock, err := newReqSocket(zctx, session)
	if err != nil {
		return helloReply{}, err
	}
	defer sock.Close()
	nonce := randomBytes(nonceSize)
	rep, err := handshakeStep(ctx, sock, session, timeout, helloRequest{Proto: ProtocolVersion, Op: "hello", Nonce: nonce, Sender: sender, RDMA: qps})
	if err != nil {
		return helloReply{}, err
	}
	switch {
	case rep.Challenge != nil && secret == nil:
		return helloReply{}, fmt.Errorf("%w: session %q requires authentication: configure the shared secret (secret, secret_file or MC_GUARD_SECRET)", ErrSession, session)
	case rep.Challenge == nil && secret != nil:
		return helloReply{}, fmt.Errorf("%w: session %q did not authenticate itself (it has no secret); refusing an unauthenticated peer", ErrSession, session)
	case rep.Challenge != nil:
		challenge := rep.Challenge
		auth := helloRequest{Proto: ProtocolVersion, Op: "auth", Nonce: nonce, Challenge: challenge, MAC: mac(secret, labelClient, challenge, nonce), Sender: sender, RDMA: qps}
		if rep, err = handshakeStep(ctx, sock, session, timeout, auth); err != nil {
			return helloReply{}, err
		}
		if !hmac.Equal(rep.MAC, mac(secret, labelServer, nonce, challenge)) {
			return helloReply{}, fmt.Errorf("%w: session %q failed to prove it knows the shared secret", ErrSession, session)
		}
		rep.Token = deriveToken(secret, challenge, nonce)
	}
	if rep.Data == "" || len(rep.Token) != wire.TokenSize {
		return helloReply{}, fmt.Errorf("%w: session %q sent an incomplete handshake reply", ErrSession, session)
	}
	return rep, nil
}

func handshakeStep(ctx context.Context, sock *zmq.Socket, session string, timeout time.Duration, req helloRequest) (helloReply, error) {
	body, _ := json.Marshal(req)
	raw, err := request(ctx, sock, session, "handshake", body, timeout)
	if err != nil {
		return helloReply{}, err
	}
	var rep helloReply
	if err := decodeStrict(raw, &rep); err != nil {
		return helloReply{}, fmt.Errorf("%w: session %q sent a malformed handshake reply: %v", ErrSession, session, err)
	}
	if rep.Error != "" {
		return helloReply{}, fmt.Errorf("%w: session %q refused the handshake: %s", ErrSession, session, rep.Error)
	}
	if rep.Proto != ProtocolVersion {
		return helloReply{}, fmt.Errorf("%w: session %q speaks protocol version %d, this guard %d", ErrSession, session, rep.Proto, ProtocolVersion)
	}
	return rep, nil
}

// decodeStrict decodes one JSON object, refusing unknown fields and
// trailing data.
func decodeStrict(b []byte, v any) error {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return err
	}
	if dec.More() {
		return fmt.Errorf("trailing data after the JSON object")
	}
	return nil
}
