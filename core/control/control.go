// Package control is a guard's control channel over ZeroMQ: the ROUTER
// endpoint that answers peers' handshakes and notices within its bounds,
// and the REQ sockets and requests a guard sends them with.
package control

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	zmq "github.com/pebbe/zmq4"

	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/core/internal/heap"
	"github.com/mcguard/mcguard/core/logs"
)

// Bounds of the control endpoint, so that no flood of peers can grow a
// guard without limit: at most maxControlConns connections (past it the
// oldest is shut down for each new one), and per connection at most
// controlHWM messages queued each way (replies to a peer that does not
// read them are dropped). An honest peer has one request in flight.
// controlBacklog is the listen queue's length (the kernel caps it at
// net.core.somaxconn).
const (
	// MaxMessage bounds what a control socket accepts from a peer.
	MaxMessage      = 2 << 20
	maxControlConns = 1024
	controlHWM      = 4
	controlBacklog  = 1024
)

// Server answers handshakes and notices on a ZMQ ROUTER socket. The
// socket has one owner, the serve goroutine, which also reads the socket's
// connection events to hold the connection cap; it stops when the context
// is terminated (its poll fails with ETERM), the ZeroMQ way to shut down.
// handle turns a peer's request body into a reply body; peer names the
// connection it came on.
type Server struct {
	Endpoint string // "host:port", the session name peers use
	done     chan struct{}
	wg       sync.WaitGroup
}

var controlMonitors atomic.Uint64 // names each control socket's monitor

func NewServer(zctx *zmq.Context, listen string, handle func(peer, body []byte) []byte) (*Server, error) {
	sock, err := zctx.NewSocket(zmq.ROUTER)
	if err != nil {
		return nil, fmt.Errorf("%w: control socket: %v", errs.Config, err)
	}
	sock.SetLinger(0)
	sock.SetMaxmsgsize(MaxMessage)
	sock.SetIpv6(true)
	sock.SetSndhwm(controlHWM)
	sock.SetRcvhwm(controlHWM)
	// ZeroMQ's accept queue holds 100 by default: a flood of strangers
	// fills it, and the kernel drops an honest peer's SYN behind them.
	sock.SetBacklog(controlBacklog)
	fail := func(err error) (*Server, error) {
		sock.Close()
		return nil, err
	}
	host, port, _ := net.SplitHostPort(listen)
	if port == "0" {
		port = "*"
	}
	ip, err := listenIP(host)
	if err != nil {
		return fail(err)
	}
	monitor := fmt.Sprintf("inproc://mcguard-control-%d", controlMonitors.Add(1))
	if err := sock.Monitor(monitor, zmq.EVENT_ACCEPTED|zmq.EVENT_DISCONNECTED|zmq.EVENT_CLOSED); err != nil {
		return fail(fmt.Errorf("%w: control socket monitor: %v", errs.Config, err))
	}
	events, err := zctx.NewSocket(zmq.PAIR)
	if err != nil {
		return fail(fmt.Errorf("%w: control socket monitor: %v", errs.Config, err))
	}
	events.SetLinger(0)
	if err := events.Connect(monitor); err != nil {
		events.Close()
		return fail(fmt.Errorf("%w: control socket monitor: %v", errs.Config, err))
	}
	if err := sock.Bind("tcp://" + net.JoinHostPort(ip.String(), port)); err != nil {
		events.Close()
		return fail(fmt.Errorf("%w: control channel cannot listen on %s: %v", errs.Config, listen, err))
	}
	last, err := sock.GetLastEndpoint()
	if err != nil {
		events.Close()
		return fail(fmt.Errorf("%w: control endpoint: %v", errs.Config, err))
	}
	_, boundPort, _ := net.SplitHostPort(last[len("tcp://"):])
	s := &Server{Endpoint: net.JoinHostPort(host, boundPort), done: make(chan struct{})}
	s.wg.Add(1)
	go s.serve(sock, events, handle)
	return s, nil
}

func (s *Server) serve(sock, events *zmq.Socket, handle func(peer, body []byte) []byte) {
	defer s.wg.Done()
	defer sock.Close()
	defer events.Close()
	poller := zmq.NewPoller()
	poller.Add(sock, zmq.POLLIN)
	poller.Add(events, zmq.POLLIN)
	conns := &controlConns{fds: map[int]string{}}
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
		for _, p := range polled {
			if p.Socket == events {
				capConnections(events, conns)
				continue
			}
			answer(sock, handle)
		}
	}
}

// answerBatch bounds the requests answered per poll: enough that a flood
// of connection events (a crowd connecting and being shut) cannot starve
// the requests, few enough that the events are read in time.
const answerBatch = 256

// answer answers the requests waiting on sock, up to answerBatch of them
// (ZeroMQ hands them over fairly, connection by connection).
func answer(sock *zmq.Socket, handle func(peer, body []byte) []byte) {
	for range answerBatch {
		msg, err := sock.RecvMessageBytes(zmq.DONTWAIT)
		if err != nil {
			return
		}
		// A REQ peer's message is [identity, "", body].
		if len(msg) != 3 || len(msg[1]) != 0 {
			continue
		}
		if _, err := sock.SendMessageDontwait(msg[0], "", handle(msg[0], msg[2])); err != nil {
			logs.Printf(logs.Info, "control reply failed: %v", err)
		}
	}
}

// controlConns are a control socket's connections, by descriptor, with
// the peer each was accepted from, in the order they came, and the most
// it had since its heap was last trimmed.
type controlConns struct {
	fds   map[int]string
	order []int // oldest first; descriptors since closed are skipped
	peak  int
}

// capConnections reads the control socket's connection events. A
// connection accepted at maxControlConns shuts down the oldest one
// (ZeroMQ then sees it end and forgets it): a flood of strangers' sockets
// cannot keep a newcomer out, and an honest peer, whose request is
// answered within moments of connecting, is long done by the time its
// connection is the oldest (a peer that keeps one open reconnects). When
// a crowd of connections has gone, the C heap they used is given back.
func capConnections(events *zmq.Socket, conns *controlConns) {
	for range answerBatch * 4 { // the rest at the next poll, after the requests
		ev, _, fd, err := events.RecvEvent(zmq.DONTWAIT)
		if err != nil {
			return
		}
		switch ev {
		case zmq.EVENT_ACCEPTED:
			for len(conns.fds) >= maxControlConns && conns.shutOldest() {
			}
			conns.fds[fd] = peerName(fd)
			conns.order = append(conns.order, fd)
			conns.peak = max(conns.peak, len(conns.fds))
		case zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED:
			delete(conns.fds, fd)
			if conns.peak >= 128 && len(conns.fds) <= conns.peak/8 {
				heap.Trim()
				conns.peak = len(conns.fds)
			}
		}
		if len(conns.order) > 2*len(conns.fds)+64 { // closed ones pile up in order: keep the live
			live := conns.order[:0]
			for _, fd := range conns.order {
				if _, ok := conns.fds[fd]; ok {
					live = append(live, fd)
				}
			}
			conns.order = live
		}
	}
}

// shutOldest shuts the oldest connection down and forgets it; false where
// none is left. A descriptor whose peer is no longer the one it was
// accepted from (closed, its number reused by another socket since) is
// forgotten without touching it.
func (c *controlConns) shutOldest() bool {
	for len(c.order) > 0 {
		fd := c.order[0]
		c.order = c.order[1:]
		peer, ok := c.fds[fd]
		if !ok {
			continue
		}
		delete(c.fds, fd)
		if peer != "" && peerName(fd) == peer {
			syscall.Shutdown(fd, syscall.SHUT_RDWR)
		}
		return true
	}
	return false
}

// peerName is the address at the other end of socket fd, "" where it has
// none.
func peerName(fd int) string {
	sa, err := syscall.Getpeername(fd)
	if err != nil {
		return ""
	}
	switch a := sa.(type) {
	case *syscall.SockaddrInet4:
		return fmt.Sprintf("%v:%d", net.IP(a.Addr[:]), a.Port)
	case *syscall.SockaddrInet6:
		return fmt.Sprintf("[%v]:%d", net.IP(a.Addr[:]), a.Port)
	}
	return ""
}

// stop tells the serve goroutine to end; terminating the context (which
// waits for its socket to close) wakes it. wait then joins it.
func (s *Server) Stop() { close(s.done) }
func (s *Server) Wait() { s.wg.Wait() }

// NewReqSocket opens a REQ socket to session's control endpoint, at the
// first of its addresses that accepts a connection, and returns that.
func NewReqSocket(ctx context.Context, zctx *zmq.Context, session string, timeout time.Duration) (*zmq.Socket, string, error) {
	addr, err := reachControl(ctx, session, timeout)
	if err != nil {
		return nil, "", err
	}
	sock, err := zctx.NewSocket(zmq.REQ)
	if err != nil {
		return nil, "", fmt.Errorf("%w: control socket: %v", errs.Session, err)
	}
	sock.SetLinger(0)
	sock.SetMaxmsgsize(MaxMessage)
	sock.SetIpv6(true)
	if err := sock.Connect("tcp://" + addr); err != nil {
		sock.Close()
		return nil, "", fmt.Errorf("%w: session %q: %v", errs.Session, session, err)
	}
	return sock, addr, nil
}

// Request sends body on a REQ socket and waits for the reply until the
// timeout or ctx ends. After an error the socket must be closed: a REQ
// that missed its reply cannot be reused (Lazy Pirate).
func Request(ctx context.Context, sock *zmq.Socket, session, what string, body []byte, timeout time.Duration) ([]byte, error) {
	if _, err := sock.SendBytes(body, 0); err != nil {
		return nil, fmt.Errorf("%w: session %q: %s send: %v", errs.Session, session, what, err)
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
			return nil, fmt.Errorf("%w: session %q did not answer the %s within %v (no guard listening there?)", errs.Timeout, session, what, timeout)
		}
		polled, err := poller.Poll(min(left, 50*time.Millisecond))
		if err != nil {
			return nil, fmt.Errorf("%w: session %q: %v", errs.Session, session, err)
		}
		if ctx.Err() != nil {
			return nil, fmt.Errorf("%w: %s with %q: %v", errs.Closed, what, session, ctx.Err())
		}
		if len(polled) > 0 {
			break
		}
	}
	raw, err := sock.RecvBytes(0)
	if err != nil {
		return nil, fmt.Errorf("%w: session %q: %s receive: %v", errs.Session, session, what, err)
	}
	return raw, nil
}

// DecodeStrict decodes one JSON object, refusing unknown fields and
// trailing data.
func DecodeStrict(b []byte, v any) error {
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
