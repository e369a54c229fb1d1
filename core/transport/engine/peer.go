package engine

import (
	"context"

	"github.com/mcguard/mcguard/core/desc"
	"github.com/mcguard/mcguard/core/memory"
	"github.com/mcguard/mcguard/core/transport"
)

// peerChecked is a session over the engine whose peer runs a guard that
// this one reached over mcguard's own connection (TCP, or the same-host
// path): the engine moves the bytes, and the read-backs are answered by
// the peer's guard out of its own memory, with the completion notices
// going on that connection too. Through the engine each read-back was
// another call into it (about 70 µs each over Mooncake's TCP, and one
// per batch of slices); here a chunk's read-backs are one round trip, or
// a cross-memory read on one host, and a notice is a write.
//
// What a read-back proves is unchanged: the bytes at the destination,
// read after the engine said the writes were complete, equal the
// source's. The engine's completion does not order the peer
// connection's read behind its writes (FenceIsFinal stays false): a
// mismatch is read again until the bytes come or the transfer's time is
// up, as through the engine.
type peerChecked struct {
	*conn
	peer    transport.Conn
	caps    transport.Caps
	notices peerNotices
	checks  checkView
}

// ConnChecked returns session's connection over the engine, whose
// read-backs (Caps.Checks) and notices go on peer, a connection to the
// peer's guard; its own reads (an application's) stay the engine's. Its
// writes join consecutive descriptors within the regions of the peer's
// table (joins). Close closes both.
func (p *Plane) ConnChecked(session string, peer transport.Conn) transport.Conn {
	c := &peerChecked{conn: &conn{p: p, session: session, reach: p.join.reach(peer)}, peer: peer}
	c.checks.peerChecked = c
	c.caps.Tagged = c.conn
	c.caps.Checks = &c.checks
	if n := peer.Caps().Notices; n != nil {
		c.notices.n = n
		c.caps.Notices = &c.notices
	}
	return c
}

// checkView is the connection as verification uses it: writes and
// fences through the engine, reads through the peer's guard.
type checkView struct{ *peerChecked }

// Read fences through the engine where asked (if it has a fence), then
// reads through the peer's guard.
func (c *checkView) Read(ctx context.Context, ranges []desc.Range, out []byte, fenced bool) error {
	if fenced {
		if err := c.conn.Fence(ctx); err != nil {
			return err
		}
	}
	return c.peer.Read(ctx, ranges, out, false)
}

func (c *peerChecked) Caps() *transport.Caps { return &c.caps }

// Refresh: the peer's guard's newer answer and table are its connection's.
func (c *peerChecked) Refresh(answer []byte, regions []memory.Region) error {
	return c.peer.Refresh(answer, regions)
}

func (c *peerChecked) Close() {
	c.conn.Close()
	c.peer.Close()
}

// peerNotices posts notices on the peer connection at once: no fence of
// that connection follows (the writes went through the engine), so a
// notice left buffered for one would never be sent.
type peerNotices struct{ n transport.NoticePoster }

func (p *peerNotices) PostNotice(ctx context.Context, body []byte, _ bool) error {
	return p.n.PostNotice(ctx, body, false)
}

func (p *peerNotices) SettleNotices(ctx context.Context) error { return p.n.SettleNotices(ctx) }
