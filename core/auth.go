package core

import (
	"container/list"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"fmt"
	"net"
	"sync"
	"time"

	"github.com/mcguard/mcguard/core/wire"
)

// Peer authentication. A guard with a secret answers a hello with a fresh
// challenge; the peer proves it knows the secret with
// HMAC-SHA256(secret, "mcguard/2 client" | challenge | its nonce), the
// guard proves itself back with the "server" label, and both derive the
// handshake's token from the "token" label. The secret never crosses the
// wire, and neither does an authenticated token: data connections and
// notices must present it, so a peer that skipped or failed the handshake
// can neither read, write nor announce.
const (
	nonceSize      = 16
	challengeLife  = 10 * time.Second
	maxChallenges  = 4096
	labelClient    = "mcguard/2 client"
	labelServer    = "mcguard/2 server"
	labelToken     = "mcguard/2 token"
	secretMinBytes = 16
)

func mac(secret []byte, label string, a, b []byte) []byte {
	m := hmac.New(sha256.New, secret)
	m.Write([]byte(label))
	m.Write(a)
	m.Write(b)
	return m.Sum(nil)
}

func deriveToken(secret, challenge, nonce []byte) []byte {
	return mac(secret, labelToken, challenge, nonce)[:wire.TokenSize]
}

func randomBytes(n int) []byte {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		panic(fmt.Sprintf("crypto/rand failed: %v", err)) // the kernel's RNG does not fail
	}
	return b
}

// authority is the server side of the handshake.
type authority struct {
	secret []byte // nil: no authentication
	tokens *tokenSet

	mu         sync.Mutex
	challenges map[string]*challenge // outstanding, single use, by peer connection
	order      list.List             // of *challenge, the oldest in front
}

// challenge is one issued to a peer connection, which must answer it on
// the same connection.
type challenge struct {
	peer, value string
	issued      time.Time
	elem        *list.Element
}

func newAuthority(secret []byte) *authority {
	return &authority{secret: secret, tokens: newTokenSet(maxSenders), challenges: map[string]*challenge{}}
}

// challenge issues a fresh single-use challenge to peer (a control
// connection). A connection has one outstanding at most, a newer one
// replacing it, so a flood's challenges are bounded by its connections;
// past maxChallenges in all the oldest goes, never the whole table.
func (a *authority) challenge(peer []byte) []byte {
	c := &challenge{peer: string(peer), value: string(randomBytes(nonceSize)), issued: time.Now()}
	a.mu.Lock()
	defer a.mu.Unlock()
	if old, ok := a.challenges[c.peer]; ok {
		a.forgetLocked(old)
	}
	for a.order.Len() > 0 {
		oldest := a.order.Front().Value.(*challenge)
		if a.order.Len() < maxChallenges && c.issued.Sub(oldest.issued) <= challengeLife {
			break
		}
		a.forgetLocked(oldest)
	}
	c.elem = a.order.PushBack(c)
	a.challenges[c.peer] = c
	return []byte(c.value)
}

func (a *authority) forgetLocked(c *challenge) {
	delete(a.challenges, c.peer)
	a.order.Remove(c.elem)
}

// answer checks a peer's proof and, if good, returns the guard's proof and
// the handshake's token, already registered. The challenge must be the one
// issued to the same connection, and is spent either way.
func (a *authority) answer(peer []byte, req helloRequest) (proof, token []byte, err error) {
	a.mu.Lock()
	c, ok := a.challenges[string(peer)]
	if ok {
		a.forgetLocked(c)
	}
	a.mu.Unlock()
	if !ok || c.value != string(req.Challenge) || time.Since(c.issued) > challengeLife {
		return nil, nil, fmt.Errorf("unknown or expired challenge")
	}
	if len(req.Nonce) != nonceSize || !hmac.Equal(req.MAC, mac(a.secret, labelClient, req.Challenge, req.Nonce)) {
		return nil, nil, fmt.Errorf("authentication failed: the peer does not know this guard's secret")
	}
	token = deriveToken(a.secret, req.Challenge, req.Nonce)
	a.tokens.add(token, req.Sender)
	return mac(a.secret, labelServer, req.Nonce, req.Challenge), token, nil
}

// isLoopback reports whether host names only this machine.
func isLoopback(host string) bool {
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}
