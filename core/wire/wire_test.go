package wire

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestHeaderRoundTrip(t *testing.T) {
	h := Header{Op: OpWrite | Reply, Status: StatusNotRegistered, ID: 42, Addr: 0xdeadbeef, Len: 4096}
	b := make([]byte, HeaderSize)
	h.Encode(b)
	got, err := Decode(b)
	require.NoError(t, err)
	require.Equal(t, h, got)
}

func TestDecodeRejectsMalformed(t *testing.T) {
	good := make([]byte, HeaderSize)
	Header{Op: OpRead, Len: 16}.Encode(good)
	mutate := func(f func(b []byte)) []byte {
		b := append([]byte(nil), good...)
		f(b)
		return b
	}
	cases := map[string][]byte{
		"short":    good[:31],
		"magic":    mutate(func(b []byte) { b[0] ^= 1 }),
		"version":  mutate(func(b []byte) { b[2] = 9 }),
		"op":       mutate(func(b []byte) { b[3] = 77 }),
		"huge len": mutate(func(b []byte) { Header{Op: OpWrite, Len: MaxPayload + 1}.Encode(b) }),
	}
	for name, b := range cases {
		_, err := Decode(b)
		require.ErrorIs(t, err, ErrFrame, name)
	}
}

func TestRanges(t *testing.T) {
	p := AppendRange(AppendRange(nil, 100, 8), 200, 16)
	a, l, total, err := DecodeRanges(p)
	require.NoError(t, err)
	require.Equal(t, []uint64{100, 200}, a)
	require.Equal(t, []uint64{8, 16}, l)
	require.EqualValues(t, 24, total)
	for name, p := range map[string][]byte{
		"empty":   nil,
		"partial": p[:20],
		"zero":    AppendRange(nil, 100, 0),
		"wraps":   AppendRange(nil, ^uint64(0)-2, 8),
		"too big": AppendRange(AppendRange(nil, 0, MaxPayload), 0, 1),
	} {
		_, _, _, err := DecodeRanges(p)
		require.ErrorIs(t, err, ErrFrame, name)
	}
}
