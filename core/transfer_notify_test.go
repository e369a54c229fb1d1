package core

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/core/auth"
	"github.com/mcguard/mcguard/core/control"
	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/verify"
)

func takeNotifies(t *testing.T, g *Guard) []Notify {
	t.Helper()
	js, _, err := g.Notifies(1 << 20)
	require.NoError(t, err)
	var out []Notify
	require.NoError(t, json.Unmarshal(js, &out))
	return out
}

func TestNotifiesArriveInOrderAndAreTakenOnce(t *testing.T) {
	p := newPair(t, "", "", 4096)
	require.Empty(t, takeNotifies(t, p.recv))
	for _, n := range []Notify{{"a", "1"}, {"b", ""}, {"c", strings.Repeat("é", 1000)}} {
		require.NoError(t, p.send.Notify(p.recv.Endpoint(), n))
	}
	// Too small a buffer keeps them queued.
	js, size, err := p.recv.Notifies(10)
	require.NoError(t, err)
	require.Nil(t, js)
	require.Greater(t, size, 10)
	require.Equal(t, []Notify{{"a", "1"}, {"b", ""}, {"c", strings.Repeat("é", 1000)}}, takeNotifies(t, p.recv))
	require.Empty(t, takeNotifies(t, p.recv))
}

func TestNotifyRefusesBadInputAndForgeries(t *testing.T) {
	p := newPair(t, "", "", 4096)
	ep := p.recv.Endpoint()
	require.ErrorIs(t, p.send.Notify(ep, Notify{Name: strings.Repeat("n", MaxNotifyName+1)}), errs.InvalidArg)
	require.ErrorIs(t, p.send.Notify(ep, Notify{Msg: strings.Repeat("m", MaxNotifyMsg+1)}), errs.InvalidArg)
	require.ErrorIs(t, p.send.Notify(ep, Notify{Msg: "\xff"}), errs.InvalidArg)
	require.ErrorIs(t, p.send.Notify("not a session", Notify{}), errs.InvalidArg)

	// A notify whose MAC does not match its message (a tampered one) is refused.
	require.NoError(t, p.send.Notify(ep, Notify{"real", "x"}))
	s := p.send.session(ep)
	s.mu.Lock()
	token, key, seq := s.hello.Token, s.hello.Key, s.seq+1
	s.seq++
	s.mu.Unlock()
	forged := control.Hello{Proto: control.ProtocolVersion, Op: "notify", Nonce: auth.RandomBytes(auth.NonceSize), Transport: "tcp",
		Token: token, Seq: seq, MAC: notifyMAC(key, token, seq, Notify{"real", "x"}), Name: "real", Msg: "y"}
	require.Error(t, p.recv.answerNotify(forged))
	forged.Msg, forged.Seq = "x", seq // the right MAC, but a replayed sequence number
	require.NoError(t, p.recv.answerNotify(forged))
	require.Error(t, p.recv.answerNotify(forged), "replay")
	require.Equal(t, []Notify{{"real", "x"}, {"real", "x"}}, takeNotifies(t, p.recv))
}

func TestNotifyQueueIsBoundedPerSender(t *testing.T) {
	var q notifyQueue
	for i := 0; i < maxNotifiesPerSender; i++ {
		require.NoError(t, q.add("flooder", Notify{Name: "n"}))
	}
	require.Error(t, q.add("flooder", Notify{Name: "n"}), "the flooder is refused")
	require.NoError(t, q.add("other", Notify{Name: "n"}), "others are not")
	require.Error(t, q.add("big", Notify{Msg: strings.Repeat("m", maxNotifyBytes)}))
	js, _, err := q.take(1 << 30)
	require.NoError(t, err)
	var out []Notify
	require.NoError(t, json.Unmarshal(js, &out))
	require.Len(t, out, maxNotifiesPerSender+1)
	require.NoError(t, q.add("flooder", Notify{Name: "n"}), "taking frees room")
}

// A read-back mode's notice (notify always) goes out at once on the data
// connection and its reply is read by the session's next call, whatever
// that call is.
func TestNoticeOnTheDataConnectionIsSentAtOnceAndCollectedNext(t *testing.T) {
	p := newPair(t, `{"verify": "tail", "notify": "always"}`, `{"sync_timeout_ms": 2000}`, 8*4096)
	fill(p.src.b)
	res, err := p.send.Transfer(p.session, p.blocks(8, 4096), TransferOptions{})
	require.NoError(t, err)
	require.NoError(t, p.recv.SyncTransfers([]uint64{res.ID}, 0), "the notice arrived without the sender's next call")
	for _, m := range []verify.Mode{verify.Off, verify.Digest, verify.Tail} {
		fill(p.src.b)
		res, err = p.send.Transfer(p.session, p.blocks(8, 4096), TransferOptions{Verify: ptr(m)})
		require.NoError(t, err, m)
		require.NoError(t, p.recv.SyncTransfers([]uint64{res.ID}, 0), m)
		require.True(t, bytes.Equal(p.src.b, p.dst.b), m)
	}
}
