package verify

import (
	"errors"
	"fmt"
	"hash/crc32"
	"slices"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/core/desc"
)

func TestDigestSeesEveryByte(t *testing.T) {
	b := make([]byte, 256<<10)
	base := desc.DigestOf(b)
	for _, i := range []int{0, 1, 4095, 128 << 10, len(b) - 1} {
		b[i] ^= 1
		require.NotEqual(t, base, desc.DigestOf(b), "flip at %d", i)
		b[i] ^= 1
	}
	require.Equal(t, base, desc.DigestOf(b))
}

func TestDigesterMatchesDigestOf(t *testing.T) {
	b := make([]byte, 10<<20+3)
	for i := range b {
		b[i] = byte(i * 31)
	}
	h := desc.NewDigester()
	for off := 0; off < len(b); off += 4 << 20 {
		h.Write(b[off:min(off+4<<20, len(b))])
	}
	require.Equal(t, desc.DigestOf(b), h.Sum64())
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
			desc.DigestOf(buf)
		}
	})
	b.Run("crc32c", func(b *testing.B) {
		b.SetBytes(int64(len(buf)))
		for i := 0; i < b.N; i++ {
			crc32.Checksum(buf, castagnoli)
		}
	})
}

// CompareDigests takes a known digest where there is one and reads the
// rest, small and large (spread over goroutines), names the ranges that
// differ either way, and asks known once per range, in order: a caller
// may look each up right after the last one found.
func TestCompareDigestsKnownAndRead(t *testing.T) {
	for _, size := range []int{4096, 256 << 10} { // 256 KiB in all, read one by one; 16 MiB, 5 MiB of it read spread
		t.Run(fmt.Sprint(size), func(t *testing.T) {
			const n = 64
			mem := make([]byte, n*size)
			for i := range mem {
				mem[i] = byte(i * 7)
			}
			ranges, want := make([]desc.Range, n), make([]uint64, n)
			for i := range ranges {
				ranges[i] = desc.Range{Addr: uint64(i * size), Len: uint64(size)}
				want[i] = desc.DigestOf(mem[i*size : (i+1)*size])
			}
			var asked []uint64
			known := func(r desc.Range) (uint64, bool) {
				asked = append(asked, r.Addr)
				i := int(r.Addr) / size
				switch {
				case i%3 == 1:
					return 0, false // not landed: read
				case i == 9:
					return want[i] ^ 1, true // landed, but other bytes
				}
				return want[i], true
			}
			var reads atomic.Int64
			digest := func(r desc.Range) (uint64, error) {
				reads.Add(1)
				if r.Addr == uint64(10*size) {
					return 0, errors.New("unreadable")
				}
				return desc.DigestOf(mem[r.Addr : r.Addr+r.Len]), nil
			}
			mem[4*size] ^= 1 // range 4 is read, and differs
			err := CompareDigests(ranges, want, known, digest, func() string { return "descriptor" })
			require.ErrorIs(t, err, ErrMismatch)
			for _, i := range []string{"descriptor 4 ", "descriptor 9 ", "descriptor 10 "} {
				require.ErrorContains(t, err, i)
			}
			require.Equal(t, 3, strings.Count(err.Error(), "descriptor "), "only those differ")
			msg := err.Error()
			require.Less(t, strings.Index(msg, "descriptor 4 "), strings.Index(msg, "descriptor 9 "), "named in order")
			require.Less(t, strings.Index(msg, "descriptor 9 "), strings.Index(msg, "descriptor 10 "), "named in order")
			require.EqualValues(t, 21, reads.Load(), "the ranges not known, and only those, are read")
			require.Len(t, asked, n, "known asked once per range")
			require.True(t, slices.IsSorted(asked), "in order")

			mem[4*size] ^= 1
			want[9] ^= 1
			require.NoError(t, CompareDigests(ranges[11:], want[11:], nil, digest, func() string { return "d" }),
				"no known digests: every range read")
		})
	}
}
