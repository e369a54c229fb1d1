// Package desc holds what every layer of a transfer names: a descriptor
// (source, destination, length), a range of remote memory, and the digest
// that digest mode compares. It imports nothing of mcguard's, so data
// planes, memory and verification all stand on it.
package desc

import "github.com/zeebo/xxh3"

// Desc is one transfer descriptor: Len bytes from local Src to remote Dst.
type Desc struct {
	Src, Dst, Len uint64
}

// Range is a span of remote memory to read back.
type Range struct {
	Addr, Len uint64
}

// DigestOf is the end-to-end checksum of digest mode: xxh3-64. It was
// measured against CRC32C (hash/crc32 with the Castagnoli table, SSE4.2)
// in BenchmarkDigest; xxh3 is faster here and its 64 bits make a chance
// match 2^32 times rarer.
func DigestOf(b []byte) uint64 { return xxh3.Hash(b) }

// Digester computes DigestOf over data written in pieces.
type Digester = *xxh3.Hasher

// NewDigester returns a Digester; its Sum64 equals DigestOf of all it was
// written.
func NewDigester() Digester { return xxh3.New() }
