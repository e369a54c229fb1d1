package transport

import (
	"context"

	"github.com/mcguard/mcguard/core/desc"
	"github.com/mcguard/mcguard/core/memory"
)

// Conn is a sender's connection to one target. Its session's lock keeps
// it to one goroutine at a time. Every blocking call returns when ctx
// ends. Write returns when the data plane reports the writes complete:
// exactly the promise this library does not trust, which is why a check
// follows.
type Conn interface {
	// Write sends descs; base is the index of descs[0] in the whole batch,
	// for messages.
	Write(ctx context.Context, descs []desc.Desc, base int) error
	// Fence returns once every earlier write is applied at the target.
	Fence(ctx context.Context) error
	// Read fetches ranges, concatenated, into out; with fenced, a fence
	// goes first in the same round trip.
	Read(ctx context.Context, ranges []desc.Range, out []byte, fenced bool) error
	// FenceIsFinal reports whether a fence's answer means that every
	// earlier write is in place at the target (TCP's in-order applied
	// acknowledgement, an RDMA READ or FLUSH on the same queue pair): a
	// mismatch read after it then is final, and polling would only wait.
	FenceIsFinal() bool
	// Caps is what the connection can do beyond these calls, fixed for
	// its life: callers look there, never at the connection's type.
	Caps() *Caps
	// Refresh takes a newer answer and region table of the same target
	// (it registered more since the connection was made).
	Refresh(answer []byte, regions []memory.Region) error
	// Close aborts the connection: nothing still queued on it may land
	// later on top of a newer transfer's bytes.
	Close()
}

// Caps is a connection's optional abilities; a nil field is one it does
// not have. A data plane fills it once, when it makes the connection.
type Caps struct {
	Post         Poster
	PostMarked   DescriptorMarker
	ReadArriving StreamReader
	ReadPosting  Pipeliner
	Notices      NoticePoster
	Transfers    TransferBound
	Tagged       TransferTagger
	// Checks is the connection verification reads back through, where
	// that is not this one (an engine's session checked through the
	// peer's guard); its writes and fences are this one's.
	Checks Conn
}

// PeerReacher says how far from dst the target's registered host memory
// runs, by its region table (0: outside it, or not known to be host
// memory): a sender joining writes keeps each inside one region there.
type PeerReacher interface {
	PeerReach(dst uint64) uint64
}

// Poster sends writes without waiting for their completions: the next
// Fence or Read reads them first, in the same flight, so a chunk's writes,
// fence and read-backs cost one round trip. A completion that reports a
// failure fails that Fence or Read.
type Poster interface {
	Post(ctx context.Context, descs []desc.Desc, base int) error
}

// DescriptorMarker posts writes whose target digests each descriptor as
// its bytes land (TCP): digest mode posts its writes marked, so the
// receiver's sync may compare those digests instead of reading the memory
// again.
type DescriptorMarker interface {
	PostMarked(ctx context.Context, descs []desc.Desc, base int) error
}

// StreamReader reads as Read does and reports the bytes as they arrive
// (arrived: how many of out's leading bytes are in place): a read-back of
// thousands of probes is compared while its later bytes are still on the
// wire, instead of after the last.
type StreamReader interface {
	ReadArriving(ctx context.Context, ranges []desc.Range, out []byte, fenced bool, arrived func(n uint64)) error
}

// Pipeliner sends the next chunk's writes while this chunk's read-back is
// answered: the fence and the read request go out, then next's writes,
// while the caller reads and compares the answer. The target applies in
// order, so the answer is of this chunk's writes alone; the target works
// on next's writes while the sender compares, instead of waiting for
// them. posted says whether next went out (a connection may decline, and
// then reads as ReadArriving does); its acknowledgements are read by
// next's own fence.
type Pipeliner interface {
	ReadPosting(ctx context.Context, ranges []desc.Range, out []byte, arrived func(n uint64), next []desc.Desc, nextBase int) (posted bool, err error)
}

// NoticePoster carries completion notices itself, in order after the
// writes (TCP): the notice and the fence go in one flight. A notice's
// answer may stay owed past the call that sent it; SettleNotices reads
// those that arrived and returns the first refusal among them.
type NoticePoster interface {
	PostNotice(ctx context.Context, body []byte, fenceFollows bool) error
	SettleNotices(ctx context.Context) error
}

// TransferBound is a connection whose target refuses writes sent before a
// quiesce (TCP). Between BeginTransfer and EndTransfer its writes go under
// the quiesces it knew of when the transfer began, and no later one: a
// transfer that began before a quiesce lands nothing in the quiesced
// ranges once the quiesce returned, however its chunks, resends and
// reconnects fall. Continue puts a connection opened within a transfer
// under that transfer's generation (Epoch).
type TransferBound interface {
	BeginTransfer(ctx context.Context) error
	EndTransfer()
	Epoch() uint64
	Continue(ctx context.Context, epoch uint64) error
}

// TransferTagger counts a connection's calls per transfer (the engine data
// plane's, for WaitEngineCalls); 0: no transfer.
type TransferTagger interface {
	SetTransfer(id uint64)
}
