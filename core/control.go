package core

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log"
	"net"
	"sync"
	"time"

	zmq "github.com/pebbe/zmq4"
)

// ProtocolVersion is spoken in the handshake; a peer with another is refused.
const ProtocolVersion = 1

// maxControlMessage bounds what a control socket accepts from a peer.
const maxControlMessage = 2 << 20

type helloRequest struct {
	Proto int    `json:"proto"`
	Op    string `json:"op"`
}

// helloReply tells a sender where to send data and what it may write to.
type helloReply struct {
	Proto   int      `json:"proto"`
	Error   string   `json:"error,omitempty"`
	Data    string   `json:"data,omitempty"`  // the target's TCP "host:port"
	Token   []byte   `json:"token,omitempty"` // binds data connections to this handshake
	Regions []Region `json:"regions,omitempty"`
}

// controlReply is the answer to a notice, or to a request that failed.
type controlReply struct {
	Proto int    `json:"proto"`
	Error string `json:"error,omitempty"`
}

// controlServer answers handshakes and notices on a ZMQ ROUTER socket. The
// socket has one owner, the serve goroutine; others reach it only through
// done. handle turns a request body into a reply body.
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
		polled, err := poller.Poll(50 * time.Millisecond)
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

func (s *controlServer) close() {
	close(s.done)
	s.wg.Wait()
}

// answerHello decodes a handshake request and answers it with hello.
func answerHello(body []byte, hello func() helloReply) []byte {
	var req helloRequest
	var rep helloReply
	if err := decodeStrict(body, &req); err != nil {
		rep = helloReply{Proto: ProtocolVersion, Error: "malformed control request: " + err.Error()}
	} else if req.Proto != ProtocolVersion {
		rep = helloReply{Proto: ProtocolVersion, Error: fmt.Sprintf("protocol version %d, this guard speaks %d", req.Proto, ProtocolVersion)}
	} else if req.Op != "hello" {
		rep = helloReply{Proto: ProtocolVersion, Error: fmt.Sprintf("unknown control op %q", req.Op)}
	} else {
		rep = hello()
	}
	out, _ := json.Marshal(rep)
	return out
}

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

// handshake asks the guard at session for its data endpoint and region
// table, on a REQ socket that lives only for this call and this goroutine.
func handshake(ctx context.Context, zctx *zmq.Context, session string, timeout time.Duration) (helloReply, error) {
	sock, err := newReqSocket(zctx, session)
	if err != nil {
		return helloReply{}, err
	}
	defer sock.Close()
	body, _ := json.Marshal(helloRequest{Proto: ProtocolVersion, Op: "hello"})
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
	if rep.Proto != ProtocolVersion || rep.Data == "" || len(rep.Token) == 0 {
		return helloReply{}, fmt.Errorf("%w: session %q sent an incomplete handshake reply (protocol %d)", ErrSession, session, rep.Proto)
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
