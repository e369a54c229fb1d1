package auth

import (
	"container/list"
	"fmt"
	"sync"
	"time"

	"github.com/mcguard/mcguard/core/transport"
	"github.com/mcguard/mcguard/core/wire"
)

// Bounds of the handshake tokens a guard keeps. What is bounded is per
// sender (one session at a peer, stable across its reconnects and
// refreshes): its newest TokensPerSender tokens. Senders are forgotten
// when unused for tokenIdle, or least recently used first past
// MaxSenders, so another peer's handshakes cannot evict a sender in use;
// one that was forgotten all the same has its next notice refused as
// unknown, and re-handshakes.
const (
	TokensPerSender = 4
	tokenIdle       = time.Hour
)

// MaxSenders bounds the senders a guard keeps tokens for (a variable, for tests).
var MaxSenders = 1 << 16

// TokenSet maps the tokens of the handshakes a guard answered to the
// senders they were issued to, each with the handshake's key and the
// sequence number of its last notice.
type TokenSet struct {
	mu      sync.Mutex
	max     int
	tokens  map[string]*token
	senders map[string]*senderTokens
	lru     list.List // of *senderTokens, the most recently used in front
}

type token struct {
	sender  *senderTokens
	key     []byte
	lastSeq uint64 // of the last notice taken: a replayed one is refused
}

type senderTokens struct {
	id     string
	tokens []string // oldest first
	used   time.Time
	elem   *list.Element
}

func newTokenSet(max int) *TokenSet {
	return &TokenSet{max: max, tokens: map[string]*token{}, senders: map[string]*senderTokens{}}
}

// add records tok as issued to sender, with the handshake's key.
func (s *TokenSet) add(tok, key, sender []byte) {
	s.mu.Lock()
	defer s.mu.Unlock()
	k := string(tok)
	if _, ok := s.tokens[k]; ok {
		return
	}
	now := time.Now()
	e, ok := s.senders[string(sender)]
	if !ok {
		e = &senderTokens{id: string(sender)}
		e.elem = s.lru.PushFront(e)
		s.senders[e.id] = e
	}
	e.tokens = append(e.tokens, k)
	s.tokens[k] = &token{sender: e, key: key}
	if len(e.tokens) > TokensPerSender {
		delete(s.tokens, e.tokens[0])
		e.tokens = e.tokens[1:]
	}
	s.touchLocked(e, now)
	for s.lru.Len() > 0 {
		oldest := s.lru.Back().Value.(*senderTokens)
		if s.lru.Len() <= s.max && now.Sub(oldest.used) < tokenIdle {
			break
		}
		s.forgetLocked(oldest)
	}
}

func (s *TokenSet) touchLocked(e *senderTokens, now time.Time) {
	e.used = now
	s.lru.MoveToFront(e.elem)
}

func (s *TokenSet) forgetLocked(e *senderTokens) {
	for _, k := range e.tokens {
		delete(s.tokens, k)
	}
	delete(s.senders, e.id)
	s.lru.Remove(e.elem)
}

// Sender returns whom tok was issued to and the handshake's key, and
// counts as a use of it.
func (s *TokenSet) Sender(tok []byte) (string, []byte, bool) {
	if len(tok) != wire.TokenSize {
		return "", nil, false
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	t, ok := s.tokens[string(tok)]
	if !ok {
		return "", nil, false
	}
	s.touchLocked(t.sender, time.Now())
	return t.sender.id, t.key, true
}

// Notice checks a notice's token, its MAC (macOK, given the key) and its
// sequence number, which must be above the last one taken under the token.
// It returns the token's sender.
func (s *TokenSet) Notice(tok []byte, seq uint64, macOK func(key []byte) bool) (string, error) {
	if len(tok) != wire.TokenSize {
		return "", ErrUnknownNoticeToken
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	t, ok := s.tokens[string(tok)]
	switch {
	case !ok:
		return "", ErrUnknownNoticeToken
	case !macOK(t.key):
		return "", fmt.Errorf("the MAC is wrong: not from the sender that shook hands")
	case seq <= t.lastSeq:
		return "", fmt.Errorf("the sequence number %d is not above %d: a replay", seq, t.lastSeq)
	}
	t.lastSeq = seq
	s.touchLocked(t.sender, time.Now())
	return t.sender.id, nil
}

// ErrUnknownNoticeToken marks a notice whose token names no handshake
// this guard knows (forgotten, or never made): the sender shakes hands again.
var ErrUnknownNoticeToken = fmt.Errorf("the notice's token belongs to no handshake with this guard (%w)", transport.ErrStaleToken)

// Size is how many senders and tokens are kept.
func (s *TokenSet) Size() (senders, tokens int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.senders), len(s.tokens)
}
