package control

import (
	"context"
	"encoding/json"
	"sync/atomic"
	"testing"
	"time"

	zmq "github.com/pebbe/zmq4"
	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/core/auth"
	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/core/wire"
)

// fakeGuard is a control endpoint that answers each request body with
// what answer returns (nothing where it returns nil), until the test ends.
func fakeGuard(t *testing.T, zctx *zmq.Context, answer func(body []byte) []byte) (endpoint string) {
	sock, err := zctx.NewSocket(zmq.ROUTER)
	require.NoError(t, err)
	sock.SetLinger(0)
	require.NoError(t, sock.Bind("tcp://127.0.0.1:*"))
	last, err := sock.GetLastEndpoint()
	require.NoError(t, err)
	stop, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		defer sock.Close()
		poller := zmq.NewPoller()
		poller.Add(sock, zmq.POLLIN)
		for {
			select {
			case <-stop:
				return
			default:
			}
			if polled, err := poller.Poll(20 * time.Millisecond); err != nil || len(polled) == 0 {
				continue
			}
			msg, err := sock.RecvMessageBytes(0)
			if err != nil || len(msg) != 3 {
				continue
			}
			if rep := answer(msg[2]); rep != nil {
				sock.SendMessage(msg[0], "", rep)
			}
		}
	}()
	t.Cleanup(func() { close(stop); <-done })
	return last[len("tcp://"):]
}

// guardThatLoses is a control endpoint that never answers the first lose
// hellos it gets (as a guard whose connection was shut under a flood never
// does) and answers the rest with a handshake without a secret.
func guardThatLoses(t *testing.T, zctx *zmq.Context, lose int64) (endpoint string, hellos *atomic.Int64) {
	hellos = new(atomic.Int64)
	endpoint = fakeGuard(t, zctx, func([]byte) []byte {
		if hellos.Add(1) <= lose {
			return nil
		}
		rep, _ := json.Marshal(HelloReply{Proto: ProtocolVersion, Token: make([]byte, wire.TokenSize), Answer: json.RawMessage(`{}`)})
		return rep
	})
	return endpoint, hellos
}

func newContext(t *testing.T) *zmq.Context {
	zctx, err := zmq.NewContext()
	require.NoError(t, err)
	t.Cleanup(func() { zctx.Term() })
	return zctx
}

// A handshake whose request was lost tries again on a new connection
// within its timeout, and one to a guard that never answers still ends
// at the timeout, saying how many tries it made.
func TestAHandshakeWhoseRequestWasLostTriesAgainOnANewConnection(t *testing.T) {
	zctx := newContext(t)
	endpoint, hellos := guardThatLoses(t, zctx, 1)
	start := time.Now()
	rep, err := Handshake(context.Background(), zctx, endpoint, 3*time.Second, nil, Hello{Transport: "tcp"})
	require.NoError(t, err)
	require.Len(t, rep.Token, wire.TokenSize)
	require.EqualValues(t, 2, hellos.Load(), "the second try got the answer")
	require.Less(t, time.Since(start), 3*time.Second)

	silent, _ := guardThatLoses(t, zctx, 1<<40)
	start = time.Now()
	_, err = Handshake(context.Background(), zctx, silent, time.Second, nil, Hello{Transport: "tcp"})
	require.ErrorIs(t, err, errs.Timeout)
	require.Contains(t, err.Error(), "3 tries")
	require.Less(t, time.Since(start), 1500*time.Millisecond, "the tries together keep to the timeout")
}

// guardThatForgetsChallenges is a control endpoint with secret that
// refuses the first forget answers to its challenges as stale (as a
// guard does whose challenge was issued to a connection ZeroMQ has since
// replaced, or crowded out by a flood), and completes the rest.
func guardThatForgetsChallenges(t *testing.T, zctx *zmq.Context, secret []byte, forget int64) (endpoint string, auths *atomic.Int64) {
	auths = new(atomic.Int64)
	endpoint = fakeGuard(t, zctx, func(body []byte) []byte {
		var req Hello
		if json.Unmarshal(body, &req) != nil {
			return nil
		}
		rep := HelloReply{Proto: ProtocolVersion}
		switch {
		case req.Op == "hello":
			rep.Challenge = auth.RandomBytes(auth.NonceSize)
		case auths.Add(1) <= forget:
			rep.Error, rep.Code = auth.ErrStaleChallenge.Error(), CodeStaleChallenge
		default:
			rep.MAC, rep.Answer = auth.MAC(secret, auth.LabelServer, req.Nonce, req.Challenge), json.RawMessage(`{}`)
		}
		out, _ := json.Marshal(rep)
		return out
	})
	return endpoint, auths
}

// A handshake whose answer reached a guard that no longer kept its
// challenge starts over with a new hello, within its timeout; a guard
// that never keeps one still ends it at the timeout, with the guard's
// reason.
func TestAHandshakeWhoseChallengeWentStaleStartsOver(t *testing.T) {
	zctx := newContext(t)
	secret := []byte("correct horse battery staple")
	endpoint, auths := guardThatForgetsChallenges(t, zctx, secret, 2)
	rep, err := Handshake(context.Background(), zctx, endpoint, 3*time.Second, secret, Hello{Transport: "tcp"})
	require.NoError(t, err)
	require.Len(t, rep.Token, wire.TokenSize)
	require.EqualValues(t, 3, auths.Load(), "the third answer was taken")

	never, _ := guardThatForgetsChallenges(t, zctx, secret, 1<<40)
	start := time.Now()
	_, err = Handshake(context.Background(), zctx, never, time.Second, secret, Hello{Transport: "tcp"})
	require.ErrorIs(t, err, errs.Session)
	require.ErrorContains(t, err, "unknown or expired challenge")
	require.Less(t, time.Since(start), 1500*time.Millisecond, "the tries together keep to the timeout")
}
