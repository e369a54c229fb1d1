// Package wire is the framing of the TCP data channel between a sending
// guard and a receiving guard's target: fixed 32-byte headers, little
// endian, each optionally followed by a payload of Len bytes.
//
//	magic u16 | version u8 | op u8 | status i32 | id u64 | addr u64 | len u64
//
// On accept the target sends a Challenge (payload: ChallengeSize fresh
// random bytes). Requests: Hello (payload: the handshake's token and a
// proof that the sender holds the handshake's key, made over that
// challenge: HelloSize bytes), Write (payload: the bytes for [addr,
// addr+len)), Read (payload: len/16 (addr u64, len u64) ranges), Fence (no
// payload: the reply comes once every earlier write on the connection is
// applied). Every request gets exactly one reply with the same id and
// op|Reply; a Read's reply carries the ranges' bytes concatenated.
package wire

import (
	"encoding/binary"
	"errors"
	"fmt"
)

const (
	Magic      = 0x4D47 // "MG"
	Version    = 2      // 2: the target's challenge, and a hello that proves a key
	HeaderSize = 32

	// MaxPayload bounds every payload, so a decoder never allocates or
	// reads from an unchecked length. Senders slice larger writes.
	MaxPayload = 64 << 20
	// MaxRanges bounds the ranges of one Read request.
	MaxRanges = 1 << 16
	// TokenSize is the length of the handshake token a Hello carries.
	TokenSize = 16
	// ChallengeSize is a Challenge's payload; ProofSize the proof a Hello
	// carries after the token.
	ChallengeSize = 16
	ProofSize     = 32
	HelloSize     = TokenSize + ProofSize
)

// Op is a frame's operation.
type Op uint8

const (
	OpHello Op = 1
	OpWrite Op = 2
	OpRead  Op = 3
	OpFence Op = 4
	// OpChallenge is sent by the target, unasked, when it accepts a
	// connection.
	OpChallenge Op = 5
	// OpMark carries a quiesce generation in Addr: the target pushes it,
	// unasked, when the receiver quiesced ranges, and the sender echoes it
	// as a request before its next writes (a Hello's Addr carries the
	// generation of the sender's handshake). A request with Status
	// MarkLower sets the connection's generation down to Addr instead.
	OpMark Op = 6
	// OpNotice carries a completion notice (EncodeNotice) to the target's
	// guard, in order after the writes it announces: no round trip of its
	// own, and it arrives after them.
	OpNotice Op = 7
	// OpProve asks a target on the same host to read the handshake's
	// nonce at Addr in the sender's memory (same-host transfers); its
	// reply's Len carries why not (an errno, or ProveNoGrant).
	OpProve Op = 8
	// OpWriteFrom is a write whose bytes the target copies out of the
	// sender's memory: Addr is the destination, the payload the source
	// address and the length (16 bytes, little-endian).
	OpWriteFrom Op = 9
	// OpWriteFromDevice is a write whose bytes the target copies out of
	// the sender's GPU memory by CUDA IPC: Addr is the destination, the
	// payload the allocation's IPC handle, the offset in it and the
	// length (IPCRefSize bytes, little-endian).
	OpWriteFromDevice Op = 10
	// Reply is or-ed into the op of a reply frame.
	Reply Op = 0x80
)

// IPCRefSize is an OpWriteFromDevice payload: a 64-byte CUDA IPC handle,
// an offset and a length.
const IPCRefSize = 64 + 8 + 8

// A refused Prove's reply says why in its Len: an errno, or one of these
// (above every errno, within MaxPayload so that the reply decodes). An
// accepted one says its lease slot in Len (slot+1; 0: none) and the slot's
// epoch in Addr, where any epoch fits.
const (
	// ProveNoGrant: the target holds no same-host grant for the
	// connection's handshake.
	ProveNoGrant = 1 << 20
	// ProveNoIdentity: the sender has not proven its process on the
	// target's identity socket (kernel credentials).
	ProveNoIdentity = 1<<20 + 1
)

// MarkLower, as an OpMark request's Status: the connection was opened
// within a transfer that began under an older generation, whose writes it
// carries on.
const MarkLower Status = 1

// Status is a reply's outcome.
type Status int32

const (
	StatusOK            Status = 0
	StatusNotRegistered Status = 1 // range outside the target's registered memory
	StatusBadRequest    Status = 2
	StatusUnauthorized  Status = 3 // no valid Hello on this connection
	StatusTooLarge      Status = 4
	StatusDevice        Status = 5 // the target could not copy into or out of GPU memory
	StatusQuiesced      Status = 6 // the receiver quiesced the range after the write was sent
	StatusStaleToken    Status = 7 // a notice under a handshake the receiver no longer knows
	StatusNoAccess      Status = 8 // the target cannot read the sender's memory (same host)
)

func (s Status) String() string {
	switch s {
	case StatusOK:
		return "ok"
	case StatusNotRegistered:
		return "range not in registered memory at the target"
	case StatusBadRequest:
		return "malformed request"
	case StatusUnauthorized:
		return "connection not bound to a handshake"
	case StatusTooLarge:
		return "request too large"
	case StatusDevice:
		return "the target's GPU copy failed"
	case StatusNoAccess:
		return "the target cannot read the sender's memory"
	case StatusStaleToken:
		return "the receiver no longer knows the notice's handshake"
	case StatusQuiesced:
		return "the receiver quiesced the range after this write was sent"
	}
	return fmt.Sprintf("status %d", int32(s))
}

// Header is one frame header.
type Header struct {
	Op     Op
	Status Status
	ID     uint64
	Addr   uint64
	Len    uint64
}

// ErrFrame marks a header that cannot be decoded.
var ErrFrame = errors.New("malformed frame")

// Encode writes h into b[:HeaderSize].
func (h Header) Encode(b []byte) {
	_ = b[HeaderSize-1]
	binary.LittleEndian.PutUint16(b[0:], Magic)
	b[2] = Version
	b[3] = byte(h.Op)
	binary.LittleEndian.PutUint32(b[4:], uint32(h.Status))
	binary.LittleEndian.PutUint64(b[8:], h.ID)
	binary.LittleEndian.PutUint64(b[16:], h.Addr)
	binary.LittleEndian.PutUint64(b[24:], h.Len)
}

// Decode parses a header and checks what can be checked without state:
// magic, version, a known op, and a payload length within MaxPayload.
func Decode(b []byte) (Header, error) {
	if len(b) < HeaderSize {
		return Header{}, fmt.Errorf("%w: %d bytes, need %d", ErrFrame, len(b), HeaderSize)
	}
	if m := binary.LittleEndian.Uint16(b[0:]); m != Magic {
		return Header{}, fmt.Errorf("%w: bad magic %#x", ErrFrame, m)
	}
	if b[2] != Version {
		return Header{}, fmt.Errorf("%w: protocol version %d, this side speaks %d", ErrFrame, b[2], Version)
	}
	h := Header{
		Op:     Op(b[3]),
		Status: Status(int32(binary.LittleEndian.Uint32(b[4:]))),
		ID:     binary.LittleEndian.Uint64(b[8:]),
		Addr:   binary.LittleEndian.Uint64(b[16:]),
		Len:    binary.LittleEndian.Uint64(b[24:]),
	}
	switch h.Op &^ Reply {
	case OpHello, OpWrite, OpRead, OpFence, OpChallenge, OpMark, OpNotice, OpProve, OpWriteFrom, OpWriteFromDevice:
	default:
		return Header{}, fmt.Errorf("%w: unknown op %#x", ErrFrame, byte(h.Op))
	}
	if h.Len > MaxPayload {
		return Header{}, fmt.Errorf("%w: length %d over the limit %d", ErrFrame, h.Len, MaxPayload)
	}
	return h, nil
}

// AppendRange appends one (addr, len) pair of a Read request's payload.
func AppendRange(b []byte, addr, n uint64) []byte {
	b = binary.LittleEndian.AppendUint64(b, addr)
	return binary.LittleEndian.AppendUint64(b, n)
}

// DecodeRanges parses a Read request's payload and returns the ranges and
// the total length they ask for. It rejects a payload that is not a whole
// number of ranges, too many ranges, a zero-length or wrapping range, and a
// total over MaxPayload.
func DecodeRanges(p []byte) (addrs, lens []uint64, total uint64, err error) {
	return DecodeRangesInto(p, nil, nil)
}

// DecodeRangesInto is DecodeRanges appending to addrs and lens (a target
// reuses them frame after frame).
func DecodeRangesInto(p []byte, addrs, lens []uint64) ([]uint64, []uint64, uint64, error) {
	if len(p)%16 != 0 || len(p) == 0 {
		return nil, nil, 0, fmt.Errorf("%w: read payload of %d bytes is not a list of ranges", ErrFrame, len(p))
	}
	n := len(p) / 16
	if n > MaxRanges {
		return nil, nil, 0, fmt.Errorf("%w: %d ranges, limit %d", ErrFrame, n, MaxRanges)
	}
	var total uint64
	for i := 0; i < n; i++ {
		a := binary.LittleEndian.Uint64(p[16*i:])
		l := binary.LittleEndian.Uint64(p[16*i+8:])
		if l == 0 || a+l < a || l > MaxPayload-total {
			return nil, nil, 0, fmt.Errorf("%w: range %d (%#x, %d) is empty, wraps or exceeds the read limit", ErrFrame, i, a, l)
		}
		addrs, lens, total = append(addrs, a), append(lens, l), total+l
	}
	return addrs, lens, total, nil
}
