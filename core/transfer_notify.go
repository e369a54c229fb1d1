package core

import (
	"crypto/hmac"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"sync"
	"unicode/utf8"

	"github.com/mcguard/mcguard/core/auth"
	"github.com/mcguard/mcguard/core/control"
	"github.com/mcguard/mcguard/core/errs"
)

// Notifies are Mooncake's TransferNotify: a name and a message that a
// sender sends after its transfer, for the receiver's application to take
// with Notifies. They travel on the control channel under the session's
// handshake (token, fresh sequence number, MAC), as an abort does, and
// wait at the receiver in a queue bounded per sender and in all.

const (
	MaxNotifyName        = 256
	MaxNotifyMsg         = 64 << 10
	maxNotifiesPerSender = 1024
	maxNotifyBytes       = 64 << 20
)

// Notify is one name and message, valid UTF-8 (they are JSON strings).
type Notify struct {
	Name string `json:"name"`
	Msg  string `json:"msg"`
}

func (n Notify) check() error {
	switch {
	case len(n.Name) > MaxNotifyName:
		return fmt.Errorf("%w: notify name of %d bytes, limit %d", errs.InvalidArg, len(n.Name), MaxNotifyName)
	case len(n.Msg) > MaxNotifyMsg:
		return fmt.Errorf("%w: notify message of %d bytes, limit %d", errs.InvalidArg, len(n.Msg), MaxNotifyMsg)
	case !utf8.ValidString(n.Name) || !utf8.ValidString(n.Msg):
		return fmt.Errorf("%w: notify name and message must be UTF-8", errs.InvalidArg)
	}
	return nil
}

func notifyMAC(key, token []byte, seq uint64, n Notify) []byte {
	b := binary.LittleEndian.AppendUint64(nil, seq)
	b = binary.LittleEndian.AppendUint32(b, uint32(len(n.Name)))
	b = append(append(b, n.Name...), n.Msg...)
	return auth.MAC(key, auth.LabelNotify, token, b)
}

// Notify sends n to session and returns once the receiver has queued it.
func (g *Guard) Notify(name string, n Notify) error {
	if err := g.enterSession(name); err != nil {
		return err
	}
	defer g.leave()
	if err := n.check(); err != nil {
		return err
	}
	ss := g.session(name)
	ctx, c := ss.callContext(g.ctx, 0)
	defer ss.endCall(c)
	s, err := g.lockSession(ctx, name, nil)
	if err != nil {
		return callErr(ctx, err)
	}
	defer s.mu.Unlock()
	if err := s.greet(ctx, g); err != nil {
		return callErr(ctx, err)
	}
	sock, _, err := control.NewReqSocket(ctx, g.zctx, s.control, g.cfg.ConnectTimeout)
	if err != nil {
		return callErr(ctx, err)
	}
	defer sock.Close()
	s.seq++
	req := control.Hello{Proto: control.ProtocolVersion, Op: "notify", Nonce: auth.RandomBytes(auth.NonceSize), Transport: g.handshakeTransport(),
		Token: s.hello.Token, Seq: s.seq, MAC: notifyMAC(s.hello.Key, s.hello.Token, s.seq, n), Name: n.Name, Msg: n.Msg}
	if _, err := control.HandshakeStep(ctx, sock, s.control, g.cfg.Timeout, req); err != nil {
		// The receiver may have forgotten this handshake: the next call
		// handshakes again.
		s.disconnect()
		return callErr(ctx, err)
	}
	return nil
}

// answerNotify queues a notify that proves its handshake.
func (g *Guard) answerNotify(req control.Hello) error {
	n := Notify{Name: req.Name, Msg: req.Msg}
	if err := n.check(); err != nil {
		return err
	}
	sender, err := g.auth.Tokens.Notice(req.Token, req.Seq, func(key []byte) bool {
		return hmac.Equal(req.MAC, notifyMAC(key, req.Token, req.Seq, n))
	})
	if err != nil {
		return err
	}
	return g.notifies.add(sender, n)
}

// Notifies returns the queued notifies, oldest first, as a JSON array,
// and takes them off the queue, only if the array fits in room bytes;
// else it returns the array's length and keeps them.
func (g *Guard) Notifies(room int) ([]byte, int, error) {
	if err := g.enter(); err != nil {
		return nil, 0, err
	}
	defer g.leave()
	return g.notifies.take(room)
}

type queuedNotify struct {
	Notify
	sender string
}

// notifyQueue is bounded per sender and in bytes: a sender that floods
// it gets refusals (its Notify calls fail), never others' messages lost.
type notifyQueue struct {
	mu        sync.Mutex
	list      []queuedNotify
	perSender map[string]int
	bytes     int
}

func (q *notifyQueue) add(sender string, n Notify) error {
	q.mu.Lock()
	defer q.mu.Unlock()
	size := len(n.Name) + len(n.Msg)
	if q.perSender[sender] >= maxNotifiesPerSender {
		return fmt.Errorf("%d of this sender's notifies are waiting to be taken", maxNotifiesPerSender)
	}
	if q.bytes+size > maxNotifyBytes {
		return fmt.Errorf("%d bytes of notifies are waiting to be taken", q.bytes)
	}
	if q.perSender == nil {
		q.perSender = map[string]int{}
	}
	q.list = append(q.list, queuedNotify{n, sender})
	q.perSender[sender]++
	q.bytes += size
	return nil
}

func (q *notifyQueue) take(room int) ([]byte, int, error) {
	q.mu.Lock()
	defer q.mu.Unlock()
	out := make([]Notify, len(q.list))
	for i, n := range q.list {
		out[i] = n.Notify
	}
	js, err := json.Marshal(out)
	if err != nil {
		return nil, 0, err
	}
	if len(js) > room {
		return nil, len(js), nil
	}
	q.list, q.perSender, q.bytes = nil, nil, 0
	return js, len(js), nil
}
