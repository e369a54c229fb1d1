package core

import (
	"bytes"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	zmq "github.com/pebbe/zmq4"
	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/core/auth"
	"github.com/mcguard/mcguard/core/control"
	"github.com/mcguard/mcguard/core/desc"
	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/core/transport"
	"github.com/mcguard/mcguard/core/transport/rdma"
	"github.com/mcguard/mcguard/core/transport/rdma/verbs"
	"github.com/mcguard/mcguard/core/wire"
	"github.com/mcguard/mcguard/verify"
)

const secretA = `"secret": "correct horse battery staple"`
const secretB = `"secret": "another secret, long enough"`

func TestAuthenticatedPeersTransfer(t *testing.T) {
	p := newPair(t, "{"+secretA+"}", "{"+secretA+"}", 64<<10)
	fill(p.src.b)
	_, err := p.send.Transfer(p.recv.Endpoint(), p.blocks(16, 4096), TransferOptions{Verify: ptr(verify.Digest)})
	require.NoError(t, err)
	res, err := p.send.Transfer(p.recv.Endpoint(), p.blocks(16, 4096), TransferOptions{Verify: ptr(verify.Digest)})
	require.NoError(t, err)
	require.NoError(t, p.recv.SyncTransfers([]uint64{res.ID}, 0), "notices carry the derived token")
	require.True(t, bytes.Equal(p.src.b, p.dst.b))
}

// With a secret, the replies verification rests on are tagged: every
// mode, over the socket (chunks posted ahead, striped connections, notices
// on the data connection) and on one host, delivers and verifies.
func TestAuthenticatedRepliesInEveryMode(t *testing.T) {
	for _, sameHost := range []string{"off", "auto"} {
		t.Run("same_host "+sameHost, func(t *testing.T) {
			js := `{` + secretA + `, "same_host": "` + sameHost + `", "max_batch": 8, "tcp_stripes": 2}`
			p := newPair(t, js, "{"+secretA+"}", 64*(16<<10))
			for _, mode := range verify.Modes {
				fill(p.src.b)
				res, err := p.send.Transfer(p.recv.Endpoint(), p.blocks(64, 16<<10), TransferOptions{Verify: ptr(mode)})
				require.NoError(t, err, mode)
				if mode == verify.Digest {
					require.NoError(t, p.recv.SyncTransfers([]uint64{res.ID}, 0))
				}
				require.True(t, bytes.Equal(p.src.b, p.dst.b), mode)
			}
		})
	}
}

func TestAuthenticationFailures(t *testing.T) {
	cases := []struct {
		name, send, recv, want string
	}{
		{"sender lacks the secret", "{}", "{" + secretA + "}", "requires authentication"},
		{"receiver lacks the secret", "{" + secretA + "}", "{}", "did not authenticate itself"},
		{"different secrets", "{" + secretA + "}", "{" + secretB + "}", "does not know this guard's secret"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p := newPair(t, tc.send, tc.recv, 4096)
			before := append([]byte(nil), p.dst.b...)
			fill(p.src.b)
			_, err := p.send.Transfer(p.recv.Endpoint(), p.blocks(1, 4096), TransferOptions{})
			require.ErrorIs(t, err, errs.Session)
			require.Contains(t, err.Error(), tc.want)
			require.Equal(t, before, p.dst.b, "nothing was written")
		})
	}
}

func TestChallengesAreSingleUse(t *testing.T) {
	g := openGuard(t, "{"+secretA+"}")
	zctx, err := zmq.NewContext()
	require.NoError(t, err)
	defer zctx.Term()
	secret := []byte("correct horse battery staple")
	sock, _, err := control.NewReqSocket(t.Context(), zctx, g.Endpoint(), time.Second)
	require.NoError(t, err)
	defer sock.Close()
	nonce := auth.RandomBytes(auth.NonceSize)
	rep, err := control.HandshakeStep(t.Context(), sock, g.Endpoint(), time.Second, control.Hello{Proto: control.ProtocolVersion, Op: "hello", Nonce: nonce, Transport: "tcp"})
	require.NoError(t, err)
	require.Len(t, rep.Challenge, auth.NonceSize)
	require.Empty(t, rep.Answer, "no endpoint before authentication")
	auth := control.Hello{Proto: control.ProtocolVersion, Op: "auth", Nonce: nonce, Challenge: rep.Challenge, MAC: auth.MAC(secret, auth.LabelClient, rep.Challenge, nonce), Transport: "tcp"}
	rep, err = control.HandshakeStep(t.Context(), sock, g.Endpoint(), time.Second, auth)
	require.NoError(t, err)
	require.NotEmpty(t, rep.Answer)
	require.Empty(t, rep.Token, "an authenticated token never crosses the wire")
	_, err = control.HandshakeStep(t.Context(), sock, g.Endpoint(), time.Second, auth)
	require.ErrorContains(t, err, "unknown or expired challenge", "a replayed answer is refused")
}

func TestListenPolicy(t *testing.T) {
	_, err := LoadConfig(nil, `{"listen": "0.0.0.0:0"}`)
	require.ErrorIs(t, err, errs.Config)
	require.Contains(t, err.Error(), "no secret")
	_, err = LoadConfig(nil, `{"listen": "0.0.0.0:0", "allow_insecure": true}`)
	require.NoError(t, err)
	_, err = LoadConfig(nil, `{"listen": "0.0.0.0:0", `+secretA+`}`)
	require.NoError(t, err)
	_, err = LoadConfig(nil, `{"secret": "short"}`)
	require.ErrorContains(t, err, "at least 16 bytes")
	f := filepath.Join(t.TempDir(), "secret")
	require.NoError(t, os.WriteFile(f, []byte("0123456789abcdef0123\n"), 0o600))
	c, err := LoadConfig(nil, `{"secret_file": "`+f+`"}`)
	require.NoError(t, err)
	require.Equal(t, "0123456789abcdef0123", string(c.Secret))
	_, err = LoadConfig(nil, `{"secret_file": "/nonexistent/secret"}`)
	require.ErrorIs(t, err, errs.Config)
}

func TestProtocolMismatchIsAClearError(t *testing.T) {
	g := openGuard(t, "")
	for _, old := range []int{3, 4} { // 3 spelled out RDMA's fields; 4 did not name the guard
		body, _ := json.Marshal(control.Hello{Proto: old, Op: "hello", Nonce: auth.RandomBytes(auth.NonceSize), Transport: "tcp"})
		require.Contains(t, sendRaw(t, g.Endpoint(), body), fmt.Sprintf("protocol version %d, this guard speaks %d", old, control.ProtocolVersion))
	}
}

// canaryMem is registered memory with unregistered canary bytes on both
// sides, to prove that no hostile write escapes its region.
type canaryMem struct {
	all *mem
	pad int
}

func newCanaryMem(t *testing.T, size, pad int) *canaryMem {
	m := &canaryMem{all: newMem(t, size+2*pad), pad: pad}
	for i := range m.all.b {
		m.all.b[i] = 0xA5
	}
	return m
}

func (c *canaryMem) addr() uint64 { return c.all.addr(c.pad) }

func (c *canaryMem) canariesIntact() bool {
	n := len(c.all.b)
	return bytes.Count(c.all.b[:c.pad], []byte{0xA5}) == c.pad && bytes.Count(c.all.b[n-c.pad:], []byte{0xA5}) == c.pad
}

func frame(h wire.Header, payload []byte) []byte {
	b := make([]byte, wire.HeaderSize)
	h.Encode(b)
	return append(b, payload...)
}

// A hostile peer on the data and control ports: garbage, truncated frames,
// huge lengths, writes without a handshake, out-of-region and wrapping
// writes, and connections that stall half-way. Meanwhile an honest peer
// keeps transferring, memory outside the region never changes, and
// nothing hangs.
func TestHostilePeers(t *testing.T) {
	const size, pad = 64 << 10, 4096
	// The honest peer writes recvMem; the hostile frames aim at and around
	// hostileMem (a peer with a token may write registered memory, so the
	// two must not share bytes), each with canaries on both sides.
	recvMem := newCanaryMem(t, size, pad)
	hostileMem := newCanaryMem(t, size, pad)
	srcMem := newMem(t, size)
	recv := openGuard(t, `{"timeout_ms": 300}`)
	send := openGuard(t, "")
	require.NoError(t, recv.Register(recvMem.addr(), size))
	require.NoError(t, recv.Register(hostileMem.addr(), size))
	require.NoError(t, send.Register(srcMem.addr(0), size))
	dataAddr := dataAddr(recv)

	// An honest peer, in parallel all along.
	stop := make(chan struct{})
	var honest sync.WaitGroup
	var honestErr error
	var honestOK int
	honest.Add(1)
	go func() {
		defer honest.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			fill(srcMem.b)
			d := []desc.Desc{{Src: srcMem.addr(0), Dst: recvMem.addr(), Len: size}}
			if _, err := send.Transfer(recv.Endpoint(), d, TransferOptions{Verify: ptr(verify.Full)}); err != nil {
				honestErr = err
				return
			}
			honestOK++
		}
	}()

	// A token from a real handshake, so the hostile writes get past hello.
	zctx, err := zmq.NewContext()
	require.NoError(t, err)
	defer zctx.Term()
	hello, err := control.Handshake(t.Context(), zctx, recv.Endpoint(), time.Second, nil, control.Hello{Transport: "tcp"})
	require.NoError(t, err)
	base := hostileMem.addr()
	// Inputs after a valid hello ("+") or on a fresh connection.
	inputs := map[string][]byte{
		"garbage":             bytes.Repeat([]byte("not a frame "), 100),
		"truncated header":    frame(wire.Header{Op: wire.OpWrite}, nil)[:17],
		"huge length":         frame(wire.Header{Op: wire.OpWrite, Addr: base, Len: 1 << 62}, nil),
		"write without hello": frame(wire.Header{Op: wire.OpWrite, Addr: base, Len: 8}, make([]byte, 8)),
		"bad token":           frame(wire.Header{Op: wire.OpHello, Len: wire.HelloSize}, make([]byte, wire.HelloSize)),
		"short token":         frame(wire.Header{Op: wire.OpHello, Len: 3}, []byte{1, 2, 3}),
		"+below the region":   frame(wire.Header{Op: wire.OpWrite, Addr: base - 16, Len: 32}, bytes.Repeat([]byte{0xEE}, 32)),
		"+past the region":    frame(wire.Header{Op: wire.OpWrite, Addr: base + size - 16, Len: 32}, bytes.Repeat([]byte{0xEE}, 32)),
		"+wrapping write":     frame(wire.Header{Op: wire.OpWrite, Addr: ^uint64(0) - 7, Len: 16}, bytes.Repeat([]byte{0xEE}, 16)),
		"+wrapping read":      frame(wire.Header{Op: wire.OpRead, Len: 16}, wire.AppendRange(nil, ^uint64(0)-7, 16)),
		"+read outside":       frame(wire.Header{Op: wire.OpRead, Len: 16}, wire.AppendRange(nil, base-pad, 64)),
		"+fence with payload": frame(wire.Header{Op: wire.OpFence, Len: 8}, make([]byte, 8)),
		"+reply op":           frame(wire.Header{Op: wire.OpWrite | wire.Reply}, nil),
		"+stall in header":    frame(wire.Header{Op: wire.OpWrite, Addr: base, Len: 64}, nil)[:20],
		"+stall in payload":   frame(wire.Header{Op: wire.OpWrite, Addr: base, Len: 4096}, make([]byte, 100)),
		"+a second hello":     frame(wire.Header{Op: wire.OpHello, Len: wire.HelloSize}, make([]byte, wire.HelloSize)),
		"silent":              nil,
	}
	var wg sync.WaitGroup
	for name, in := range inputs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c, err := net.Dial("tcp", dataAddr)
			if err != nil {
				t.Errorf("%s: %v", name, err)
				return
			}
			defer c.Close()
			challenge, err := readChallenge(c)
			if err != nil {
				t.Errorf("%s: %v", name, err)
				return
			}
			if strings.HasPrefix(name, "+") {
				if err := bindData(c, hello, challenge); err != nil {
					t.Errorf("%s: %v", name, err)
					return
				}
			}
			c.Write(in)
			// The target answers (a refusal) or hangs up; a stall is cut
			// at timeout_ms.
			c.SetReadDeadline(time.Now().Add(5 * time.Second))
			if _, err := c.Read(make([]byte, 1<<16)); err != nil {
				if ne, ok := err.(net.Error); ok && ne.Timeout() {
					t.Errorf("%s: the target neither answered nor hung up", name)
				}
			}
		}()
	}
	// Garbage on the control port, below ZeroMQ's framing.
	for _, in := range [][]byte{bytes.Repeat([]byte{0xff}, 4096), {0xff, 0, 0, 0, 0, 0, 0, 0, 1, 0x7f}, []byte("GET / HTTP/1.1\r\n\r\n")} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c, err := net.Dial("tcp", recv.Endpoint())
			if err != nil {
				return
			}
			defer c.Close()
			c.Write(in)
			c.SetReadDeadline(time.Now().Add(500 * time.Millisecond))
			c.Read(make([]byte, 1024))
		}()
	}
	wg.Wait()
	time.Sleep(100 * time.Millisecond)
	close(stop)
	honest.Wait()
	require.NoError(t, honestErr, "the honest peer kept being served")
	require.Positive(t, honestOK)
	require.True(t, recvMem.canariesIntact(), "memory outside the registered regions is byte-for-byte unchanged")
	require.True(t, hostileMem.canariesIntact(), "memory outside the registered regions is byte-for-byte unchanged")

	// And it still serves honest peers afterwards.
	fill(srcMem.b)
	_, err = send.Transfer(recv.Endpoint(), []desc.Desc{{Src: srcMem.addr(0), Dst: recvMem.addr(), Len: size}}, TransferOptions{Verify: ptr(verify.Full)})
	require.NoError(t, err)
	require.True(t, bytes.Equal(srcMem.b, recvMem.all.b[pad:pad+size]))
}

func TestUnregisterWhilePeerWrites(t *testing.T) {
	const size = 256 << 10
	src, dst := newMem(t, size), newMem(t, size)
	send := openGuard(t, `{"verify": "off"}`)
	recv := openGuard(t, "")
	require.NoError(t, send.Register(src.addr(0), size))
	require.NoError(t, recv.Register(dst.addr(0), size))
	fill(src.b)
	failed := make(chan error, 1)
	go func() {
		d := []desc.Desc{{Src: src.addr(0), Dst: dst.addr(0), Len: size}}
		for {
			if _, err := send.Transfer(recv.Endpoint(), d, TransferOptions{}); err != nil {
				failed <- err
				return
			}
		}
	}()
	time.Sleep(30 * time.Millisecond)
	require.NoError(t, recv.Unregister(dst.addr(0)))
	// From here on the memory is the application's again: mark it and
	// check that no write lands in it.
	for i := range dst.b {
		dst.b[i] = 0x5A
	}
	err := <-failed
	// Refused at its header, or cut off mid-payload (its connection
	// closed by the unregister): either way not applied.
	require.True(t, errors.Is(err, errs.NotRegistered) || errors.Is(err, errs.Peer), "%v", err)
	time.Sleep(50 * time.Millisecond)
	require.Equal(t, len(dst.b), bytes.Count(dst.b, []byte{0x5A}))
}

func TestHugeCountsAreRefusedBeforeAllocating(t *testing.T) {
	b := make([]byte, wire.NoticeHeaderSize)
	copy(b, "MGN1")
	binary.LittleEndian.PutUint32(b[16:], 1<<30) // total
	binary.LittleEndian.PutUint32(b[24:], 1<<30) // count
	_, err := wire.DecodeNotice(b, len(verify.Modes), nil)
	require.ErrorIs(t, err, wire.ErrFrame)
}

func TestSlowlorisIsCutAtTheDeadline(t *testing.T) {
	recv := openGuard(t, `{"timeout_ms": 200}`)
	zctx, err := zmq.NewContext()
	require.NoError(t, err)
	defer zctx.Term()
	hello, err := control.Handshake(t.Context(), zctx, recv.Endpoint(), time.Second, nil, control.Hello{Transport: "tcp"})
	require.NoError(t, err)
	for name, stall := range map[string][]byte{
		"before hello":     nil,
		"half a header":    frame(wire.Header{Op: wire.OpWrite, Len: 64}, nil)[:20],
		"half the payload": frame(wire.Header{Op: wire.OpRead, Len: 32}, make([]byte, 16)),
	} {
		c, err := net.Dial("tcp", dataAddr(recv))
		require.NoError(t, err)
		challenge, err := readChallenge(c)
		require.NoError(t, err, name)
		if stall != nil {
			require.NoError(t, bindData(c, hello, challenge), name)
			c.Write(stall)
		}
		start := time.Now()
		c.SetReadDeadline(time.Now().Add(3 * time.Second))
		_, err = c.Read(make([]byte, 64))
		require.Error(t, err, name)
		ne, isNet := err.(net.Error)
		require.False(t, isNet && ne.Timeout(), "%s: the target hung up by itself", name)
		require.Less(t, time.Since(start), time.Second, name)
		c.Close()
	}
}

func TestTransportChoiceSaysWhy(t *testing.T) {
	g := openGuard(t, `{"transport": "auto", "verbs_library": "/nonexistent/libibverbs.so.1"}`)
	require.Contains(t, stats(t, g)["rdma"], "cannot load /nonexistent/libibverbs.so.1")
	require.Equal(t, "tcp", stats(t, g)["transport"])
	for _, js := range []string{`{"transport": "rdma"}`, `{"require_rdma": true}`} {
		_, err := Open(testConfig(t, js))
		require.ErrorIs(t, err, errs.Config, js)
		require.Contains(t, err.Error(), "transport rdma was required, and it is not usable", js)
	}
	tcp := openGuard(t, `{"transport": "tcp"}`)
	require.Equal(t, "not probed (transport tcp)", stats(t, tcp)["rdma"])
}

// A sender that reconnects drops its older data connection at the target,
// so bytes still on their way over the old one cannot land on top of
// newer writes.
func TestReconnectDropsTheOlderConnection(t *testing.T) {
	recv := openGuard(t, "")
	m := newMem(t, 4096)
	require.NoError(t, recv.Register(m.addr(0), 4096))
	sender := auth.RandomBytes(auth.NonceSize)
	dial := func() net.Conn { return dataConn(t, recv, shakeHands(t, recv, sender)) }
	old := dial()
	defer old.Close()
	fresh := dial()
	defer fresh.Close()
	old.Write(frame(wire.Header{Op: wire.OpWrite, ID: 2, Addr: m.addr(0), Len: 8}, []byte("LATEBYTE")))
	old.SetReadDeadline(time.Now().Add(2 * time.Second))
	_, err := old.Read(make([]byte, 64))
	require.Error(t, err, "the target hung up the older connection")
	require.Equal(t, make([]byte, 8), m.b[:8], "and applied nothing from it")
	fresh.Write(frame(wire.Header{Op: wire.OpWrite, ID: 2, Addr: m.addr(0), Len: 8}, []byte("NEWBYTES")))
	_, err = io.ReadFull(fresh, make([]byte, wire.HeaderSize))
	require.NoError(t, err)
	require.Equal(t, []byte("NEWBYTES"), m.b[:8])
}

func TestHandshakeAskingForTooManyQueuePairsIsRefused(t *testing.T) {
	g := openGuard(t, "{"+rdmaKey(t)+"}")
	body, _ := json.Marshal(control.Hello{Proto: control.ProtocolVersion, Op: "hello", Nonce: auth.RandomBytes(auth.NonceSize), Transport: "rdma", Offer: qpOffer(make([]verbs.QPInfo, rdma.MaxQPs+1))})
	require.Contains(t, sendRaw(t, g.Endpoint(), body), "17 queue pairs asked for, at most 16")
}

func TestHandshakeWithBogusQueuePairsIsRefusedAndTheGuardServesOn(t *testing.T) {
	key := rdmaKey(t)
	p := newPair(t, "{"+key+"}", "{"+key+"}", 4096)
	bogus := verbs.QPInfo{QPN: 7}
	copy(bogus.GID[:], "not a NIC's GID!")
	body, _ := json.Marshal(control.Hello{Proto: control.ProtocolVersion, Op: "hello", Nonce: auth.RandomBytes(auth.NonceSize), Transport: "rdma", Offer: qpOffer([]verbs.QPInfo{bogus})})
	require.Contains(t, sendRaw(t, p.recv.Endpoint(), body), "cannot connect queue pairs to the peer's")
	fill(p.src.b)
	_, err := p.send.Transfer(p.recv.Endpoint(), p.blocks(1, 4096), TransferOptions{})
	require.NoError(t, err)
	require.True(t, bytes.Equal(p.src.b, p.dst.b))
}

// dataConn opens a data connection to g bound to hello, a handshake's
// reply, as a sender's dial makes it.
func dataConn(t testing.TB, g *Guard, hello control.HelloReply) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", dataAddr(g))
	require.NoError(t, err)
	challenge, err := readChallenge(c)
	require.NoError(t, err)
	require.NoError(t, bindData(c, hello, challenge))
	return c
}

// shakeHands makes one handshake with g as sender.
func shakeHands(t testing.TB, g *Guard, sender []byte) control.HelloReply {
	t.Helper()
	zctx, err := zmq.NewContext()
	require.NoError(t, err)
	defer zctx.Term()
	hello, err := control.Handshake(t.Context(), zctx, g.Endpoint(), time.Second, nil, control.Hello{Sender: sender, Transport: "tcp"})
	require.NoError(t, err)
	return hello
}

// readChallenge reads the challenge a target sends on accepting c.
func readChallenge(c net.Conn) ([]byte, error) {
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	defer c.SetReadDeadline(time.Time{})
	b := make([]byte, wire.HeaderSize+wire.ChallengeSize)
	if _, err := io.ReadFull(c, b); err != nil {
		return nil, err
	}
	if h, err := wire.Decode(b); err != nil || h.Op != wire.OpChallenge {
		return nil, fmt.Errorf("no challenge: %v", err)
	}
	return b[wire.HeaderSize:], nil
}

// helloFor is the Hello frame that binds a connection with challenge to
// the handshake hello, as a sender's dial makes it.
func helloFor(hello control.HelloReply, challenge []byte) []byte {
	return frame(wire.Header{Op: wire.OpHello, ID: 1, Len: wire.HelloSize},
		append(append([]byte(nil), hello.Token...), transport.ConnectionProof(hello.Key, challenge)...))
}

// bindData sends the hello for challenge on c and reads its reply, which
// must accept it.
func bindData(c net.Conn, hello control.HelloReply, challenge []byte) error {
	c.Write(helloFor(hello, challenge))
	reply := make([]byte, wire.HeaderSize)
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	defer c.SetReadDeadline(time.Time{})
	if _, err := io.ReadFull(c, reply); err != nil {
		return err
	}
	if h, err := wire.Decode(reply); err != nil || h.Status != wire.StatusOK {
		return fmt.Errorf("hello refused: %v %v", h.Status, err)
	}
	return nil
}

// qpOffer is an RDMA sender's part of a handshake request.
func qpOffer(qps []verbs.QPInfo) []byte {
	b, _ := json.Marshal(map[string]any{"qps": qps})
	return b
}

// With a secret, nothing seen on the wire lets a third party write: a
// data connection's hello proves the handshake's key over a challenge
// fresh to that connection, so the bytes of an honest hello, replayed on
// another connection, are refused. (The landed version sent the token in
// clear and took it from anyone.)
func TestSniffedHelloIsWorthNothing(t *testing.T) {
	recv := openGuard(t, "{"+secretA+"}")
	m := newMem(t, 4096)
	require.NoError(t, recv.Register(m.addr(0), 4096))
	zctx, err := zmq.NewContext()
	require.NoError(t, err)
	defer zctx.Term()
	hello, err := control.Handshake(t.Context(), zctx, recv.Endpoint(), time.Second, []byte("correct horse battery staple"), control.Hello{Transport: "tcp"})
	require.NoError(t, err)
	honest, err := net.Dial("tcp", dataAddr(recv))
	require.NoError(t, err)
	defer honest.Close()
	challenge, err := readChallenge(honest)
	require.NoError(t, err)
	sniffed := helloFor(hello, challenge)
	require.NoError(t, bindData(honest, hello, challenge), "the honest sender's hello is taken")

	replay, err := net.Dial("tcp", dataAddr(recv))
	require.NoError(t, err)
	defer replay.Close()
	_, err = readChallenge(replay)
	require.NoError(t, err)
	replay.Write(sniffed)
	replay.Write(frame(wire.Header{Op: wire.OpWrite, ID: 2, Addr: m.addr(0), Len: 8}, []byte("INJECTED")))
	reply := make([]byte, wire.HeaderSize)
	replay.SetReadDeadline(time.Now().Add(2 * time.Second))
	_, err = io.ReadFull(replay, reply)
	require.NoError(t, err)
	h, err := wire.Decode(reply)
	require.NoError(t, err)
	require.Equal(t, wire.StatusUnauthorized, h.Status, "a replayed hello is refused")
	time.Sleep(50 * time.Millisecond)
	require.Equal(t, make([]byte, 8), m.b[:8], "and nothing it sent was written")
	honest.Write(frame(wire.Header{Op: wire.OpWrite, ID: 2, Addr: m.addr(0), Len: 8}, []byte("HONEST!!")))
	_, err = io.ReadFull(honest, reply)
	require.NoError(t, err)
	require.Equal(t, []byte("HONEST!!"), m.b[:8], "the honest connection was not displaced")
}

// mac is HMAC-SHA256 over label | a | b, for keys shorter than, equal to
// and longer than a block, and messages that fit the stack buffer or not.
func TestMACIsHMAC(t *testing.T) {
	for _, keyLen := range []int{0, 1, 16, 32, 63, 64, 65, 100, 200} {
		for _, msgLen := range []int{0, 1, 55, 64, 1000, 5000} {
			key, a, b := auth.RandomBytes(keyLen), auth.RandomBytes(msgLen), auth.RandomBytes(msgLen/3)
			m := hmac.New(sha256.New, key)
			m.Write([]byte(auth.LabelNotice))
			m.Write(a)
			m.Write(b)
			require.Equal(t, m.Sum(nil), auth.MAC(key, auth.LabelNotice, a, b), "key %d, message %d", keyLen, msgLen)
		}
	}
}
