package core

import (
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
	challenges map[string]time.Time // outstanding, single use
}

func newAuthority(secret []byte) *authority {
	return &authority{secret: secret, tokens: newTokenSet(maxSenders), challenges: map[string]time.Time{}}
}

// challenge issues a fresh single-use challenge.
func (a *authority) challenge() []byte {
	c := randomBytes(nonceSize)
	now := time.Now()
	a.mu.Lock()
	defer a.mu.Unlock()
	for k, t := range a.challenges {
		if now.Sub(t) > challengeLife {
			delete(a.challenges, k)
		}
	}
	if len(a.challenges) >= maxChallenges { // a flood: forget them all rather than grow
		clear(a.challenges)
	}
	a.challenges[string(c)] = now
	return c
}

// answer checks a peer's proof and, if good, returns the guard's proof and
// the handshake's token, already registered.
func (a *authority) answer(req helloRequest) (proof, token []byte, err error) {
	a.mu.Lock()
	issued, ok := a.challenges[string(req.Challenge)]
	delete(a.challenges, string(req.Challenge))
	a.mu.Unlock()
	if !ok || time.Since(issued) > challengeLife {
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
