package wire

import (
	"encoding/binary"
	"fmt"
	"slices"
)

// A completion notice tells a receiving guard that a transfer's writes
// were sent and fenced, which destination ranges they cover and, in digest
// mode, each descriptor's digest. It travels over the ZMQ control channel
// in chunks of at most MaxNoticeDescs descriptors:
//
//	magic "MGN2" | mode u8 | pad [3] | id u64 | total u32 | base u32 | count u32 | pad u32
//	token [16] (the sender's handshake token: only a peer that shook hands may announce)
//	seq u64 (per handshake, increasing: a replayed notice is refused)
//	mac [16] (keyed by the handshake's key over the rest: NoticeMACOffset)
//	count x (dst u64 | len u64 | digest u64)
const (
	noticeMagic      = "MGN2"
	NoticeHeaderSize = 72
	NoticeMACOffset  = 56
	NoticeMACSize    = 16
	NoticeDescSize   = 24
	MaxNoticeDescs   = 1 << 15
	// MaxNoticeTotal bounds the descriptors of one transfer (MC_GUARD_MAX_DESCRIPTORS).
	MaxNoticeTotal = 1 << 24
)

// NoticeDesc is one destination range and its digest (0 unless digest mode).
type NoticeDesc struct {
	Dst, Len, Digest uint64
}

// Notice is one chunk of a transfer's completion notice.
type Notice struct {
	Token []byte // TokenSize bytes
	Seq   uint64
	MAC   []byte // NoticeMACSize bytes
	ID    uint64
	Mode  uint8 // index into verify.Modes
	Total int   // descriptors in the whole transfer
	Base  int   // index of Descs[0] in the transfer
	Descs []NoticeDesc
}

// IsNotice tells a notice from the JSON messages on the same channel.
func IsNotice(b []byte) bool { return len(b) >= 4 && string(b[:4]) == noticeMagic }

// EncodeNotice appends n to b.
func EncodeNotice(b []byte, n Notice) []byte {
	b = append(b, noticeMagic...)
	b = append(b, n.Mode, 0, 0, 0)
	b = binary.LittleEndian.AppendUint64(b, n.ID)
	b = binary.LittleEndian.AppendUint32(b, uint32(n.Total))
	b = binary.LittleEndian.AppendUint32(b, uint32(n.Base))
	b = binary.LittleEndian.AppendUint32(b, uint32(len(n.Descs)))
	b = binary.LittleEndian.AppendUint32(b, 0)
	var tok [TokenSize]byte
	copy(tok[:], n.Token)
	b = append(b, tok[:]...)
	b = binary.LittleEndian.AppendUint64(b, n.Seq)
	var mac [NoticeMACSize]byte
	copy(mac[:], n.MAC)
	b = append(b, mac[:]...)
	for _, d := range n.Descs {
		b = binary.LittleEndian.AppendUint64(b, d.Dst)
		b = binary.LittleEndian.AppendUint64(b, d.Len)
		b = binary.LittleEndian.AppendUint64(b, d.Digest)
	}
	return b
}

// NoticeID is the transfer id of an encoded notice (0 if b is too short).
func NoticeID(b []byte) uint64 {
	if len(b) < 16 {
		return 0
	}
	return binary.LittleEndian.Uint64(b[8:])
}

// DecodeNotice parses a notice, checking every length before using it.
// Its Token and MAC are slices of b; its Descs are appended to descs[:0]
// (a buffer the caller reuses, or nil).
func DecodeNotice(b []byte, modes int, descs []NoticeDesc) (Notice, error) {
	if len(b) < NoticeHeaderSize || !IsNotice(b) {
		return Notice{}, fmt.Errorf("%w: notice of %d bytes has no notice header", ErrFrame, len(b))
	}
	n := Notice{
		Mode:  b[4],
		ID:    binary.LittleEndian.Uint64(b[8:]),
		Total: int(binary.LittleEndian.Uint32(b[16:])),
		Base:  int(binary.LittleEndian.Uint32(b[20:])),
		Token: b[32 : 32+TokenSize : 32+TokenSize], // within b, which the caller gives up
		Seq:   binary.LittleEndian.Uint64(b[48:]),
		MAC:   b[NoticeMACOffset : NoticeMACOffset+NoticeMACSize : NoticeMACOffset+NoticeMACSize],
	}
	count := int(binary.LittleEndian.Uint32(b[24:]))
	switch {
	case b[5]|b[6]|b[7] != 0 || binary.LittleEndian.Uint32(b[28:]) != 0:
		return Notice{}, fmt.Errorf("%w: notice has non-zero reserved bytes", ErrFrame)
	case int(n.Mode) >= modes:
		return Notice{}, fmt.Errorf("%w: notice names verify mode %d", ErrFrame, n.Mode)
	case count == 0 || count > MaxNoticeDescs:
		return Notice{}, fmt.Errorf("%w: notice chunk of %d descriptors (1 to %d)", ErrFrame, count, MaxNoticeDescs)
	case n.Total > MaxNoticeTotal || n.Base+count > n.Total:
		return Notice{}, fmt.Errorf("%w: notice chunk [%d, +%d) does not fit a transfer of %d", ErrFrame, n.Base, count, n.Total)
	case len(b) != NoticeHeaderSize+count*NoticeDescSize:
		return Notice{}, fmt.Errorf("%w: notice of %d bytes, %d descriptors need %d", ErrFrame, len(b), count, NoticeHeaderSize+count*NoticeDescSize)
	}
	n.Descs = slices.Grow(descs[:0], count)[:count]
	for i := range n.Descs {
		p := b[NoticeHeaderSize+i*NoticeDescSize:]
		d := NoticeDesc{Dst: binary.LittleEndian.Uint64(p), Len: binary.LittleEndian.Uint64(p[8:]), Digest: binary.LittleEndian.Uint64(p[16:])}
		if d.Len == 0 || d.Dst+d.Len < d.Dst {
			return Notice{}, fmt.Errorf("%w: notice descriptor %d (%#x, %d) is empty or wraps", ErrFrame, n.Base+i, d.Dst, d.Len)
		}
		n.Descs[i] = d
	}
	return n, nil
}
