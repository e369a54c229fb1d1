package verify

import (
	"hash/crc32"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestDigestSeesEveryByte(t *testing.T) {
	b := make([]byte, 256<<10)
	base := DigestOf(b)
	for _, i := range []int{0, 1, 4095, 128 << 10, len(b) - 1} {
		b[i] ^= 1
		require.NotEqual(t, base, DigestOf(b), "flip at %d", i)
		b[i] ^= 1
	}
	require.Equal(t, base, DigestOf(b))
}

func TestDigesterMatchesDigestOf(t *testing.T) {
	b := make([]byte, 10<<20+3)
	for i := range b {
		b[i] = byte(i * 31)
	}
	h := NewDigester()
	for off := 0; off < len(b); off += 4 << 20 {
		h.Write(b[off:min(off+4<<20, len(b))])
	}
	require.Equal(t, DigestOf(b), h.Sum64())
}

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// BenchmarkDigest compares the two candidates on a 256 KiB descriptor.
func BenchmarkDigest(b *testing.B) {
	buf := make([]byte, 256<<10)
	for i := range buf {
		buf[i] = byte(i * 7)
	}
	b.Run("xxh3-64", func(b *testing.B) {
		b.SetBytes(int64(len(buf)))
		for i := 0; i < b.N; i++ {
			DigestOf(buf)
		}
	})
	b.Run("crc32c", func(b *testing.B) {
		b.SetBytes(int64(len(buf)))
		for i := 0; i < b.N; i++ {
			crc32.Checksum(buf, castagnoli)
		}
	})
}
