// Package transport is the one door every data plane goes through: an
// interface that covers both ends of a data plane (the sender's
// connection; the target's registration, handshake answer and settle),
// and the helpers that cut batches into slices and groups. Each data plane
// lives in a folder of its own below this one (tcp, rdma); core chooses
// among them in one table (core/transports.go).
package transport

import (
	"context"
	"errors"

	"github.com/mcguard/mcguard/core/cuda"
	"github.com/mcguard/mcguard/core/memory"
)

// ErrStaleToken marks a completion notice refused because the receiver no
// longer knows the handshake it was signed under (forgotten while idle,
// crowded out): the sender shakes hands again and announces once more.
var ErrStaleToken = errors.New("the receiver no longer knows this session's handshake")

// ErrJoinRefused marks a write of joined descriptors (Cursor) that the
// target refused as outside its registered memory: its regions changed
// since the sender's table (one cut in two), and the descriptors may
// each lie inside one of them.
var ErrJoinRefused = errors.New("a write of consecutive descriptors crossed the end of a region registered at the target since the handshake")

// ConnAuth is the handshake a data connection proved at its hello (its
// token and key), for the notices that come on it: a notice under that
// handshake is the connection's sender's even where the guard has since
// forgotten the handshake (crowded out, idle), as the connection's writes
// are. LastSeq is the last such notice's sequence number (replays are
// refused); only the connection's serve loop touches it.
type ConnAuth struct {
	Token, Key []byte
	Sender     string // the sending session's id (Peer.Sender)
	LastSeq    uint64
}

// Peer is what the control plane settled in a handshake that a data plane
// needs to bind its connections to it.
type Peer struct {
	// Sender is the sending session's id, stable across reconnects: a
	// target replaces a sender's older connections (and their late bytes).
	Sender string
	// Token names the handshake; Key proves the sender took part in it
	// (ConnectionProof). Without a shared secret the key is the token.
	Token, Key []byte
	// Host is the address the sender reached the target's guard at (for
	// a target that listens on every interface and cannot name one).
	Host string
}

// Transport is one data plane of a guard, both ends. A guard sends over
// one data plane and serves every data plane it opened.
type Transport interface {
	// Name is what handshakes call the data plane ("tcp", "rdma").
	Name() string
	// Describe says what the data plane runs on, for stats.
	Describe() string

	// Register makes a registered region reachable by peers over this
	// data plane (an RDMA memory region, say); Unregister undoes it, and
	// fails where a peer may still be writing into the region.
	Register(addr, n uint64, mem cuda.Memory) error
	Unregister(addr uint64) error

	// Dial begins a connection to a target: the dialer's Offer travels in
	// the handshake request, and the target's answer finishes it.
	Dial() (Dialer, error)
	// Accept is the target's part of a handshake: its answer to a
	// sender's offer (nil: the sender only refreshes its region table),
	// for the regions the handshake reply lists, in that order.
	Accept(peer Peer, offer []byte, regions []memory.Region) (answer []byte, err error)
	// Settle returns once no write into ranges that this data plane
	// acknowledged or began to apply can still land, or with ctx's error.
	Settle(ctx context.Context, ranges []memory.Region) error
	// Quiesce returns once no write into ranges that was sent before the
	// call can land any more: those being applied have finished, and those
	// still on their way are refused when they arrive. Where the data
	// plane cannot promise that, it says so in its error.
	Quiesce(ctx context.Context, ranges []memory.Region) error
	// Abort makes sure nothing more from the peer's connections lands (the
	// sender gave up on a transfer); it returns once that holds.
	Abort(peer Peer) error
	// Connections counts the peers' connections served (for metrics).
	Connections() int
	// Stats adds what the data plane counts to a guard's stats.
	Stats(out map[string]any)

	// Close ends the target side and releases everything; the
	// connections it dialed must be closed first.
	Close()
}

// Dialer is a sender's connection in the making.
type Dialer interface {
	// Offer is the sender's part of the handshake request (nil: none).
	Offer() []byte
	// Connect finishes the connection with the target's answer and
	// region table. The dialer is spent either way.
	Connect(ctx context.Context, peer Peer, answer []byte, regions []memory.Region) (Conn, error)
	// Abandon releases a dialer whose handshake failed.
	Abandon()
}

// Landed answers, for one completion notice, with the digests its target
// took of descriptors as they landed: ok only for a descriptor that landed
// whole on the notice's connection before it and that no later write
// through the target overlapped (tcp/landed.go says what that proves).
type Landed interface {
	// Digest finds the descriptor [addr, addr+n) among them: at is its
	// place in landing order, -1 if it is not there; ok says its digest
	// is good to compare.
	Digest(addr, n uint64) (digest uint64, at int, ok bool)
	// DigestAt is Digest asking the descriptor at place k only: here
	// says whether that is [addr, addr+n). A sync asks in the notice's
	// order, which is landing order, so it finds each where the last
	// one ended, without a search.
	DigestAt(k int, addr, n uint64) (digest uint64, here, ok bool)
	Len() int
	Release() // the sync is done with them
}
