// Package auth is how guards know each other: the handshake's challenge
// and proofs under the shared secret, the token and key each handshake
// yields, the MACs on notices and aborts, and the table of tokens a guard
// answered (bounded per sender).
package auth

import (
	"container/list"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"errors"
	"fmt"
	"net"
	"sync"
	"time"

	"github.com/mcguard/mcguard/core/reuse"
	"github.com/mcguard/mcguard/core/wire"
)

// Peer authentication. A guard with a secret answers a hello with a fresh
// challenge, on that control connection; the peer proves it knows the
// secret with HMAC-SHA256(secret, "mcguard/2 client" | challenge | its
// nonce), the guard proves itself back with the "server" label, and both
// derive the handshake's token (its name) and key from the "token" and
// "key" labels. The secret and the key never cross the wire: a data
// connection's hello proves the key over a challenge fresh to that
// connection, and a notice carries a MAC under the key and a sequence
// number, so a peer that did not take part in the handshake can neither
// read, write nor announce, even with every byte of the wire in hand.
const (
	NonceSize      = 16
	challengeLife  = 10 * time.Second
	maxChallenges  = 4096
	LabelClient    = "mcguard/2 client"
	LabelServer    = "mcguard/2 server"
	labelToken     = "mcguard/2 token"
	labelKey       = "mcguard/4 key"
	LabelNotice    = "mcguard/4 notice"
	LabelAbort     = "mcguard/4 abort"
	LabelNotify    = "mcguard/4 notify"
	SecretMinBytes = 16
)

// MAC is HMAC-SHA256(secret, label | a | b) (RFC 2104), computed with
// sha256.Sum256 over buffers on the stack instead of hmac.New's hash
// objects: every notice is signed by its sender and checked by its
// receiver, and hmac.New allocates a dozen times. Longer messages than
// the stack buffer holds (large notices) take a pooled buffer.
// TestMACIsHMAC holds it to crypto/hmac.
func MAC(secret []byte, label string, a, b []byte) []byte {
	sum := macSum(secret, label, a, b)
	return sum[:]
}

// macBufs hold the inner hash's input where it outgrows macSum's stack
// (a notice of more than about 60 descriptors), reused.
var macBufs = sync.Pool{New: func() any { return new([]byte) }}

// macStack is the inner hash's input that macSum keeps on its stack.
const macStack = 1024

// macSum is MAC without allocating: a notice's MAC allocates nothing.
func macSum(secret []byte, label string, a, b []byte) [sha256.Size]byte {
	if sha256.BlockSize+len(label)+len(a)+len(b) > macStack {
		p := macBufs.Get().(*[]byte)
		sum, buf := macSumIn((*p)[:0], secret, label, a, b)
		*p = reuse.Keep(buf)
		macBufs.Put(p)
		return sum
	}
	var stack [macStack]byte
	sum, _ := macSumIn(stack[:0], secret, label, a, b)
	return sum
}

// macSumIn is HMAC-SHA256 over label | a | b, building the inner hash's
// input in buf (grown if need be, and returned).
func macSumIn(buf, secret []byte, label string, a, b []byte) ([sha256.Size]byte, []byte) {
	const block = sha256.BlockSize
	var key [block]byte
	if len(secret) > block {
		sum := sha256.Sum256(secret)
		copy(key[:], sum[:])
	} else {
		copy(key[:], secret)
	}
	for _, k := range key {
		buf = append(buf, k^0x36)
	}
	buf = append(append(append(buf, label...), a...), b...)
	inner := sha256.Sum256(buf)
	var outer [block + sha256.Size]byte
	for i, k := range key {
		outer[i] = k ^ 0x5c
	}
	copy(outer[block:], inner[:])
	return sha256.Sum256(outer[:]), buf
}

// DeriveToken is the handshake's token, its name on the wire.
func DeriveToken(secret, challenge, nonce []byte) []byte {
	return MAC(secret, labelToken, challenge, nonce)[:wire.TokenSize]
}

// DeriveKey is the handshake's key: data connections and notices prove
// they come from its sender with it. It never crosses the wire.
func DeriveKey(secret, challenge, nonce []byte) []byte {
	return MAC(secret, labelKey, challenge, nonce)
}

// NoticeMAC is the MAC of an encoded notice under the handshake's key:
// over everything but the MAC field.
func NoticeMAC(key, body []byte) (m [wire.NoticeMACSize]byte) {
	sum := macSum(key, LabelNotice, body[:wire.NoticeMACOffset], body[wire.NoticeHeaderSize:])
	copy(m[:], sum[:])
	return m
}

// RandomBytes is n bytes from the system's random source.
func RandomBytes(n int) []byte {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		panic(fmt.Sprintf("crypto/rand failed: %v", err)) // the kernel's RNG does not fail
	}
	return b
}

// Authority is the server side of the handshake.
type Authority struct {
	secret []byte // nil: no authentication
	Tokens *TokenSet

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

// NewAuthority answers with secret (nil: no authentication).
func NewAuthority(secret []byte) *Authority {
	return &Authority{secret: secret, Tokens: newTokenSet(MaxSenders), challenges: map[string]*challenge{}}
}

// Challenge issues a fresh single-use challenge to peer (a control
// connection). A connection has one outstanding at most, a newer one
// replacing it, so a flood's challenges are bounded by its connections;
// past maxChallenges in all the oldest goes, never the whole table.
func (a *Authority) Challenge(peer []byte) []byte {
	c := &challenge{peer: string(peer), value: string(RandomBytes(NonceSize)), issued: time.Now()}
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

func (a *Authority) forgetLocked(c *challenge) {
	delete(a.challenges, c.peer)
	a.order.Remove(c.elem)
}

// Answer checks a peer's proof and, if good, returns the guard's proof and
// the handshake's token and key, already registered. The challenge must be
// the one issued to the same connection, and is spent either way.
// Proof is a peer's answer to a challenge: the challenge, its nonce, its
// MAC over both, and the sender it speaks for.
type Proof struct {
	Challenge, Nonce, MAC, Sender []byte
}

func (a *Authority) Answer(peer []byte, req Proof) (proof, token, key []byte, err error) {
	a.mu.Lock()
	c, ok := a.challenges[string(peer)]
	if ok {
		a.forgetLocked(c)
	}
	a.mu.Unlock()
	if !ok || c.value != string(req.Challenge) || time.Since(c.issued) > challengeLife {
		return nil, nil, nil, ErrStaleChallenge
	}
	if len(req.Nonce) != NonceSize || !hmac.Equal(req.MAC, MAC(a.secret, LabelClient, req.Challenge, req.Nonce)) {
		return nil, nil, nil, fmt.Errorf("authentication failed: the peer does not know this guard's secret")
	}
	token, key = DeriveToken(a.secret, req.Challenge, req.Nonce), DeriveKey(a.secret, req.Challenge, req.Nonce)
	a.Tokens.add(token, key, req.Sender)
	return MAC(a.secret, LabelServer, req.Nonce, req.Challenge), token, key, nil
}

// ErrStaleChallenge: the answer is to no challenge this guard still keeps
// for that connection (spent, expired, crowded out by a flood, or issued
// to a connection since replaced): a new hello gets a new one.
var ErrStaleChallenge = errors.New("unknown or expired challenge")

// Authenticates says whether peers must prove they know the secret.
func (a *Authority) Authenticates() bool { return a.secret != nil }

// Open is a handshake without a secret: a fresh token, which is its key
// too, registered to sender.
func (a *Authority) Open(sender []byte) (token []byte) {
	token = RandomBytes(wire.TokenSize)
	a.Tokens.add(token, token, sender)
	return token
}

// IsLoopback reports whether host names only this machine.
func IsLoopback(host string) bool {
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}
