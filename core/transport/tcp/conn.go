package tcp

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/mcguard/mcguard/core/desc"
	"github.com/mcguard/mcguard/core/transport/samehost"

	"golang.org/x/sys/unix"

	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/core/fault"
	"github.com/mcguard/mcguard/core/memory"
	"github.com/mcguard/mcguard/core/transport"
	"github.com/mcguard/mcguard/core/wire"
)

// conn is one reused data connection to a target. It is used only under
// its session's lock.
type conn struct {
	caps  transport.Caps
	c     net.Conn
	cut   func()          // closes c: unregistering a source mid-write cuts the transfer off
	local *memory.Regions // the sources
	// finalFence: the target said its fence answers after every earlier
	// write is applied.
	finalFence bool
	// landing: the target digests marked writes as they land (PostMarked).
	landing bool
	// acksFinal: the target answers each write once it is in place, and
	// holds none back (Fence).
	acksFinal bool
	// hostOnly: the target has no CUDA driver, so all it registers is
	// host memory (joinReach).
	hostOnly bool
	// mac checks the tags of the replies verification rests on, where the
	// guards share a secret (replytag.go); nil: none.
	mac        *replyMAC
	fallbacks  *samehost.Fallbacks // counts a same-host fallback (the transport's)
	macReplies bool                // set mac at the hello
	// mark is the newest quiesce generation the target pushed; echoed, the
	// newest one echoed back (writes after the echo are taken).
	mark, echoed uint64
	// within: a transfer is under way (BeginTransfer), whose writes all go
	// under quiesce generation epoch, however many marks come meanwhile.
	within bool
	epoch  uint64
	// refused: a notice's refusal read ahead of SettleNotices (takeArrived).
	refused error
	r       *bufio.Reader
	w       *bufio.Writer
	timeout time.Duration
	until   time.Time // the deadline set last, for the poll reader
	wuntil  time.Time // the write deadline set last (renew)
	nextID  uint64
	hdr     [wire.HeaderSize]byte // a frame being sent
	rhdr    [wire.HeaderSize]byte // a reply being read (a field: a local would escape)
	readReq []byte                // a Read frame's ranges, reused
	// owed are the posted writes whose acknowledgements are not read yet:
	// the next request reads them first, in the same flight.
	owed []owedAck
	// spareOwed is a second list for owed, and poster the goroutine that
	// posts a next chunk's writes into it while the caller reads this
	// chunk's answers (pipeline.go).
	spareOwed []owedAck
	poster    *poster
	// pull: the target copies host-memory sources out of this process
	// (same host), so writes carry addresses instead of bytes.
	pull bool
	// ipc: device-memory sources go as CUDA IPC handles (same host, a
	// driver on both sides, another process).
	ipc bool
	// lease: this connection may write into the target itself (same
	// host, push.go), counting the bytes in pushed; iovLocal, iovRemote,
	// ranges and pins are a push's, kept for the next. unfenced: writes
	// went through the socket since the last fence.
	lease     *samehost.LeaseHolder
	pushed    *atomic.Int64
	mapped    *atomic.Int64 // of pushed, those copied into a mapped shared allocation
	joined    *atomic.Int64 // descriptors written inside another's write (nil: not counted)
	iovLocal  []unix.Iovec
	iovRemote []unix.RemoteIovec
	ranges    []desc.Range
	copies    []samehost.CopyPair // a push's memcpys into the target's mapped allocations
	gap       []byte              // where a pull's bytes between two ranges go (gapPiece)
	pins      []memory.Held
	unfenced  bool
	ringed    *atomic.Int64   // notices put in the lease's notice ring (postRinged)
	faults    *fault.Injector // the target's drop, tear or stale, injected here for pushed writes
	// rc is the socket, for unread's peek (nil: not a socket); peekNow
	// is that peek, made once, and peeked its result.
	rc      syscall.RawConn
	peekNow func(fd uintptr) bool
	peeked  int
	// closedByPeer: the last peek found the target's end closed. A
	// same-host push checks it: a process's sockets close before its pid
	// can be another process's.
	closedByPeer bool
	// watched is the context abortOn watches for the connection's life,
	// unwatch stops that.
	watched  context.Context
	unwatch  func() bool
	peekedAt time.Time // when (pushFirst peeks at most every peekEvery)
	// batch is the frames queued for one writev: a large batch's
	// writes, or one large payload (send).
	batch batched
	// peer is the target's region table, shared by a session's stripes;
	// reach, how far a joined write may span (transport.Cursor), made once.
	peer  *peerTable
	reach func(src, dst uint64) uint64
}

// dial opens a data connection to addr and says hello. A target at its
// bound of connections shuts the oldest that has not said a valid hello
// for each newcomer (a flood of strangers can put an honest connection
// among them): one shut before its hello was answered is opened again, up
// to maxDialTries times, within ctx.
func dial(ctx context.Context, addr string, peer transport.Peer, table *peerTable, gen uint64, cfg *Config, stripe int) (*conn, error) {
	for try := 1; ; try++ {
		t, err := dialOnce(ctx, addr, peer, table, gen, cfg, stripe)
		if err == nil || !errors.Is(err, errShutBeforeHello) || try == maxDialTries || ctx.Err() != nil {
			return t, err
		}
		time.Sleep(time.Duration(try) * 10 * time.Millisecond)
	}
}

// maxDialTries bounds dial's tries of a connection shut before its hello.
const maxDialTries = 4

// errShutBeforeHello marks a data connection the target closed before it
// answered the hello.
var errShutBeforeHello = errors.New("the target closed the connection before answering its hello")

func dialOnce(ctx context.Context, addr string, peer transport.Peer, table *peerTable, gen uint64, cfg *Config, stripe int) (*conn, error) {
	timeout, local := cfg.Timeout, cfg.Regions
	connectCtx, cancel := context.WithTimeout(ctx, timeout)
	c, err := transport.Connect(connectCtx, addr)
	cancel()
	if err != nil {
		return nil, fmt.Errorf("%w: data connection to %s: %v", errs.Peer, addr, err)
	}
	if tc, ok := c.(*net.TCPConn); ok {
		tc.SetNoDelay(true)
	}
	c = unpoll(c)
	t := &conn{c: c, cut: func() { c.Close() }, local: local, w: bufio.NewWriterSize(c, 256<<10), timeout: timeout,
		mark: gen, echoed: gen, peer: table, macReplies: cfg.MACReplies}
	t.reach = t.joinReach
	t.caps = transport.Caps{Post: t, PostMarked: t, ReadArriving: t, ReadPosting: t, Notices: t, Transfers: t}
	var src io.Reader = c
	if pr, err := readerOf(c, &t.until, cfg.BusyPoll, cfg.spins); err == nil {
		src = pr
	}
	t.r = bufio.NewReaderSize(src, 256<<10)
	if sc, ok := c.(syscall.Conn); ok {
		if rc, err := sc.SyscallConn(); err == nil {
			t.rc, t.peekNow = rc, t.peek
		}
	}
	if err := t.hello(ctx, peer, stripe); err != nil {
		t.Close()
		return nil, err
	}
	return t, nil
}

// shutEarly marks err, an I/O failure of a hello, as errShutBeforeHello
// where the target closed the connection (rather than let it time out).
func shutEarly(what string, err error) error {
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE) {
		return fmt.Errorf("%w: %s on the data connection: %w", errs.Peer, what, errors.Join(errShutBeforeHello, err))
	}
	return ioErr(what, err)
}

// Close aborts the connection (RST): bytes still queued for a peer we gave
// up on must not arrive later and overwrite a newer transfer's.
func (t *conn) Close() {
	if l, ok := t.c.(interface{ SetLinger(int) error }); ok {
		l.SetLinger(0)
	}
	t.c.Close()
	for _, o := range t.owed {
		if o.release != nil {
			o.release()
		}
	}
	t.owed = nil
	if t.poster != nil {
		t.poster.stop()
		t.poster = nil
	}
	if t.lease != nil {
		t.lease.Close()
		t.lease = nil
	}
	if t.unwatch != nil {
		t.unwatch()
		t.unwatch, t.watched = nil, nil
	}
}

// gatherMin is the payload from which a frame is written with writev,
// header and payload straight from where they are, instead of being
// copied through the buffered writer (which would copy all but what fits
// after the frames already buffered).
const gatherMin = 64 << 10

func (t *conn) send(h wire.Header, payload []byte) error {
	if err := t.writeBatch(); err != nil { // the frames queued before it, in order
		return err
	}
	if len(payload) >= gatherMin { // by itself, through the batch's writev
		if err := t.queue(h, payload); err != nil {
			return err
		}
		return t.writeBatch()
	}
	t.nextID++
	h.ID = t.nextID
	h.Encode(t.hdr[:])
	if _, err := t.w.Write(t.hdr[:]); err != nil {
		return ioErr("send", err)
	}
	if _, err := t.w.Write(payload); err != nil {
		return ioErr("send", err)
	}
	return nil
}

// recv reads one reply and checks it answers the request with id and op.
func (t *conn) recv(op wire.Op, id uint64) (wire.Header, error) {
	hdr := t.rhdr[:]
	var h wire.Header
	for {
		if _, err := io.ReadFull(t.r, hdr); err != nil {
			return wire.Header{}, ioErr("receive", err)
		}
		var err error
		if h, err = wire.Decode(hdr); err != nil {
			return wire.Header{}, fmt.Errorf("%w: bad reply from target: %v", errs.Peer, err)
		}
		if h.Op != wire.OpMark {
			break
		}
		t.mark = max(t.mark, h.Addr) // a quiesce at the receiver: echoed before the next writes
	}
	pulled := op == wire.OpWrite && (h.Op == wire.OpWriteFrom|wire.Reply || h.Op == wire.OpWriteFromDevice|wire.Reply) // a write is any kind
	if (h.Op != op|wire.Reply && !pulled) || h.ID != id {
		return wire.Header{}, fmt.Errorf("%w: reply out of step (op %#x id %d, want op %#x id %d)", errs.Peer, byte(h.Op), h.ID, byte(op|wire.Reply), id)
	}
	if t.mac != nil && tagged(op) {
		t.mac.begin(hdr)
		if op != wire.OpRead || h.Status != wire.StatusOK || h.Len == 0 {
			// No payload: the tag follows the header. A read-back's comes
			// after its bytes (readReply).
			if err := t.mac.check(t.r, op); err != nil {
				return wire.Header{}, err
			}
		}
	}
	return h, nil
}

// request sends one frame and waits for its reply.
func (t *conn) request(ctx context.Context, op wire.Op, payload []byte) (wire.Header, error) {
	return t.requestAt(ctx, op, 0, payload)
}

// requestAt is request with the frame's Addr.
func (t *conn) requestAt(ctx context.Context, op wire.Op, addr uint64, payload []byte) (wire.Header, error) {
	t.deadline(ctx)
	if err := t.send(wire.Header{Op: op, Addr: addr, Len: uint64(len(payload))}, payload); err != nil {
		return wire.Header{}, err
	}
	if err := t.w.Flush(); err != nil {
		return wire.Header{}, ioErr("send", err)
	}
	return t.owedThen(op, t.nextID)
}

// FenceIsFinal is what the target said of its fence.
func (t *conn) FenceIsFinal() bool { return t.finalFence }

// Caps: everything but per-transfer tags (transport.Caps).
func (t *conn) Caps() *transport.Caps { return &t.caps }

// Refresh takes the target's newer region table (for joined writes): a
// TCP target checks every write itself, and has no new answer.
func (t *conn) Refresh(_ []byte, regions []memory.Region) error {
	t.peer.set(regions)
	return nil
}

// hello answers the target's challenge: the token, and the proof over
// the challenge that the sender holds the handshake's key.
func (t *conn) hello(ctx context.Context, peer transport.Peer, stripe int) error {
	t.deadline(ctx)
	var hdr [wire.HeaderSize]byte
	if _, err := io.ReadFull(t.r, hdr[:]); err != nil {
		return shutEarly("receive the challenge", err)
	}
	h, err := wire.Decode(hdr[:])
	if err != nil || h.Op != wire.OpChallenge || h.Len != wire.ChallengeSize {
		return fmt.Errorf("%w: the target sent no challenge (%v)", errs.Peer, err)
	}
	challenge := make([]byte, wire.ChallengeSize)
	if _, err := io.ReadFull(t.r, challenge); err != nil {
		return shutEarly("receive the challenge", err)
	}
	if t.macReplies {
		t.mac = newReplyMAC(peer.Key, challenge)
	}
	payload := append(append(make([]byte, 0, wire.HelloSize), peer.Token...), transport.ConnectionProof(peer.Key, challenge)...)
	// The hello's Status names the connection's stripe (tcp_stripes): the
	// target replaces a sender's connection only by one of the same stripe.
	if err := t.send(wire.Header{Op: wire.OpHello, Status: wire.Status(stripe), Addr: t.mark, Len: uint64(len(payload))}, payload); err != nil {
		return err
	}
	if err := t.w.Flush(); err != nil {
		return shutEarly("send the hello", err)
	}
	if _, err := io.ReadFull(t.r, t.rhdr[:]); err != nil {
		return shutEarly("receive the hello's answer", err)
	}
	rep, err := wire.Decode(t.rhdr[:])
	switch {
	case err != nil || rep.Op != wire.OpHello|wire.Reply || rep.ID != t.nextID:
		return fmt.Errorf("%w: the target's answer to the hello is malformed (%v)", errs.Peer, err)
	case rep.Status != wire.StatusOK:
		return fmt.Errorf("%w: target refused the data connection: %v", errs.Peer, rep.Status)
	}
	return nil
}

// unread reports, without waiting, whether bytes the target sent wait
// unread (between requests that can only be pushed marks): one
// non-blocking peek, not a read deadline, which would wait for the poller.
func (t *conn) unread() bool {
	if t.r.Buffered() > 0 {
		return true
	}
	if t.rc == nil {
		return false
	}
	t.peeked = 0
	t.rc.Read(t.peekNow)
	return t.peeked > 0
}

// peek looks for a byte waiting on the socket without taking it, and
// notes whether the target closed the connection (its process ended).
func (t *conn) peek(fd uintptr) bool {
	var b [1]byte
	var err error
	t.peeked, _, err = syscall.Recvfrom(int(fd), b[:], syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
	t.closedByPeer = t.peeked == 0 && err == nil || err != nil && err != syscall.EAGAIN && err != syscall.EINTR
	t.peekedAt = time.Now()
	return true
}

func statusErr(s wire.Status) error {
	switch s {
	case wire.StatusQuiesced:
		return errs.Quiesced
	case wire.StatusNotRegistered:
		return errs.NotRegistered
	case wire.StatusDevice:
		return errs.Device
	}
	return errs.Peer
}

func ioErr(what string, err error) error {
	if errors.Is(err, os.ErrDeadlineExceeded) {
		return fmt.Errorf("%w: %s on the data connection: %v", errs.Timeout, what, err)
	}
	return fmt.Errorf("%w: %s on the data connection: %v", errs.Peer, what, err)
}
