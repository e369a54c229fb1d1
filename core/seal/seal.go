// Package seal is what a producer publishes of ranges whose bytes are
// final, for a reader that pulls them: each range's address, length,
// xxh3-64 digest and last bytes, the producer's identity, and a MAC under
// the guards' shared secret. A reader compares the bytes it landed with
// the seal, so a read that returns the producer's later bytes (its blocks
// reused) or only part of them fails, never succeeds. The seal is a few
// dozen bytes per range and travels in the application's metadata.
package seal

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"fmt"

	"github.com/mcguard/mcguard/core/errs"
)

// Layout, little endian:
//
//	header: magic "MCS1", flags (1: MACed), 3 bytes zero, producer id
//	        (16 bytes), serial (8), count (4), 4 bytes zero
//	count entries: remote address (8), length (8), digest (8), tail (16)
//	MAC (32 bytes) when flags says so: HMAC-SHA256 of all before it.
const (
	magic      = "MCS1"
	headerSize = 40
	entrySize  = 40
	macSize    = sha256.Size
	flagMAC    = 1

	// IDSize is a producer's identity.
	IDSize = 16
	// TailSize is the number of last bytes of each range a seal keeps
	// (fewer for a shorter range, the rest zero).
	TailSize = 16
	// MaxRanges bounds a seal's ranges.
	MaxRanges = 1 << 24
)

// Size is the largest seal of n ranges.
func Size(n int) int { return headerSize + n*entrySize + macSize }

// Entry is one sealed range.
type Entry struct {
	Addr, Len uint64
	Digest    uint64
	Tail      [TailSize]byte
}

// Seal is a decoded seal.
type Seal struct {
	Producer [IDSize]byte
	Serial   uint64
	Entries  []Entry
	MACed    bool
}

// TailOf is the tail a seal keeps of b: its last TailSize bytes, zero
// padded.
func TailOf(b []byte) (t [TailSize]byte) {
	copy(t[:], b[max(0, len(b)-TailSize):])
	return t
}

// Encode writes s, with a MAC under key when key is set.
func Encode(s Seal, key []byte) []byte {
	out := make([]byte, headerSize, Size(len(s.Entries)))
	copy(out, magic)
	if key != nil {
		out[4] = flagMAC
	}
	copy(out[8:], s.Producer[:])
	binary.LittleEndian.PutUint64(out[24:], s.Serial)
	binary.LittleEndian.PutUint32(out[32:], uint32(len(s.Entries)))
	var e [entrySize]byte
	for _, en := range s.Entries {
		binary.LittleEndian.PutUint64(e[0:], en.Addr)
		binary.LittleEndian.PutUint64(e[8:], en.Len)
		binary.LittleEndian.PutUint64(e[16:], en.Digest)
		copy(e[24:], en.Tail[:])
		out = append(out, e[:]...)
	}
	if key != nil {
		out = append(out, mac(key, out)...)
	}
	return out
}

// Decode parses b. With key set the seal must carry a MAC under it; a
// seal with a MAC is refused without a key to check it (the reader would
// take on trust what the producer meant to be checked). Every failure
// wraps errs.Seal.
func Decode(b []byte, key []byte) (Seal, error) {
	var s Seal
	if len(b) < headerSize || string(b[:4]) != magic {
		return s, fmt.Errorf("%w: not a seal (%d bytes, no header)", errs.Seal, len(b))
	}
	if b[4]&^flagMAC != 0 || b[5] != 0 || b[6] != 0 || b[7] != 0 || binary.LittleEndian.Uint32(b[36:]) != 0 {
		return s, fmt.Errorf("%w: unknown flags or version", errs.Seal)
	}
	s.MACed = b[4]&flagMAC != 0
	copy(s.Producer[:], b[8:24])
	s.Serial = binary.LittleEndian.Uint64(b[24:])
	n := binary.LittleEndian.Uint32(b[32:])
	want := headerSize + int(n)*entrySize
	if s.MACed {
		want += macSize
	}
	switch {
	case n == 0 || n > MaxRanges:
		return s, fmt.Errorf("%w: %d ranges (1 to %d)", errs.Seal, n, MaxRanges)
	case len(b) != want:
		return s, fmt.Errorf("%w: %d bytes where %d ranges take %d (truncated or padded)", errs.Seal, len(b), n, want)
	case key != nil && !s.MACed:
		return s, fmt.Errorf("%w: the seal carries no MAC, and this guard has a secret: it must come from a producer that shares it", errs.Seal)
	case key == nil && s.MACed:
		return s, fmt.Errorf("%w: the seal carries a MAC, and this guard has no secret to check it", errs.Seal)
	case key != nil && !hmac.Equal(b[want-macSize:], mac(key, b[:want-macSize])):
		return s, fmt.Errorf("%w: the seal's MAC does not match (forged, altered, or from a producer with another secret)", errs.Seal)
	}
	s.Entries = make([]Entry, n)
	for i := range s.Entries {
		e := b[headerSize+i*entrySize:]
		en := &s.Entries[i]
		en.Addr = binary.LittleEndian.Uint64(e[0:])
		en.Len = binary.LittleEndian.Uint64(e[8:])
		en.Digest = binary.LittleEndian.Uint64(e[16:])
		copy(en.Tail[:], e[24:40])
		if en.Len == 0 || en.Addr+en.Len < en.Addr {
			return s, fmt.Errorf("%w: range %d is empty or wraps", errs.Seal, i)
		}
	}
	return s, nil
}

func mac(key, b []byte) []byte {
	m := hmac.New(sha256.New, key)
	m.Write([]byte("mcguard/5 seal"))
	m.Write(b)
	return m.Sum(nil)
}
