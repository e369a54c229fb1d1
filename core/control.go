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
const maxControlMessage = 1 << 20

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

// controlServer answers handshakes on a ZMQ ROUTER socket. The socket has
// one owner, the serve goroutine; others talk to it only through done.
type controlServer struct {
	endpoint string // "host:port", the session name peers use
	done     chan struct{}
	wg       sync.WaitGroup
}

func newControlServer(zctx *zmq.Context, listen string, answer func(helloRequest) helloReply) (*controlServer, error) {
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
	go s.serve(sock, answer)
	return s, nil
}

func (s *controlServer) serve(sock *zmq.Socket, answer func(helloRequest) helloReply) {
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
		var req helloRequest
		var rep helloReply
		if err := decodeStrict(msg[2], &req); err != nil {
			rep = helloReply{Proto: ProtocolVersion, Error: "malformed handshake: " + err.Error()}
		} else if req.Proto != ProtocolVersion {
			rep = helloReply{Proto: ProtocolVersion, Error: fmt.Sprintf("protocol version %d, this guard speaks %d", req.Proto, ProtocolVersion)}
		} else if req.Op != "hello" {
			rep = helloReply{Proto: ProtocolVersion, Error: fmt.Sprintf("unknown control op %q", req.Op)}
		} else {
			rep = answer(req)
		}
		body, _ := json.Marshal(rep)
		if _, err := sock.SendMessage(msg[0], "", body); err != nil {
			log.Printf("mcguard: control reply failed: %v", err)
		}
	}
}

func (s *controlServer) close() {
	close(s.done)
	s.wg.Wait()
}

// handshake asks the guard at session for its data endpoint and region
// table. The REQ socket lives only for this call (a REQ that timed out
// cannot be reused: Lazy Pirate), and this goroutine is its only owner.
func handshake(ctx context.Context, zctx *zmq.Context, session string, timeout time.Duration) (helloReply, error) {
	sock, err := zctx.NewSocket(zmq.REQ)
	if err != nil {
		return helloReply{}, fmt.Errorf("%w: control socket: %v", ErrSession, err)
	}
	defer sock.Close()
	sock.SetLinger(0)
	sock.SetMaxmsgsize(maxControlMessage)
	if err := sock.Connect("tcp://" + session); err != nil {
		return helloReply{}, fmt.Errorf("%w: session %q: %v", ErrSession, session, err)
	}
	body, _ := json.Marshal(helloRequest{Proto: ProtocolVersion, Op: "hello"})
	if _, err := sock.SendBytes(body, 0); err != nil {
		return helloReply{}, fmt.Errorf("%w: session %q: handshake send: %v", ErrSession, session, err)
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
			return helloReply{}, fmt.Errorf("%w: session %q did not answer the handshake within %v (no guard listening there?)", ErrTimeout, session, timeout)
		}
		polled, err := poller.Poll(min(left, 50*time.Millisecond))
		if err != nil {
			return helloReply{}, fmt.Errorf("%w: session %q: %v", ErrSession, session, err)
		}
		if ctx.Err() != nil {
			return helloReply{}, fmt.Errorf("%w: handshake with %q: %v", ErrClosed, session, ctx.Err())
		}
		if len(polled) > 0 {
			break
		}
	}
	raw, err := sock.RecvBytes(0)
	if err != nil {
		return helloReply{}, fmt.Errorf("%w: session %q: handshake receive: %v", ErrSession, session, err)
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
