package wire

import (
	"bytes"
	"testing"
)

// The decoders face the network: whatever the bytes, they return a value
// that keeps its invariants, or an error — never a panic, never an
// allocation sized by an unchecked length.

func FuzzDecodeHeader(f *testing.F) {
	b := make([]byte, HeaderSize)
	Header{Op: OpWrite, ID: 1, Addr: 4096, Len: 64}.Encode(b)
	f.Add(b)
	f.Add([]byte("MG"))
	f.Fuzz(func(t *testing.T, in []byte) {
		h, err := Decode(in)
		if err != nil {
			return
		}
		if h.Len > MaxPayload {
			t.Fatalf("accepted length %d", h.Len)
		}
		out := make([]byte, HeaderSize)
		h.Encode(out)
		if !bytes.Equal(out, in[:HeaderSize]) {
			t.Fatalf("round trip changed the header")
		}
	})
}

func FuzzDecodeRanges(f *testing.F) {
	f.Add(AppendRange(AppendRange(nil, 4096, 64), 8192, 16))
	f.Add([]byte{1, 2, 3})
	f.Fuzz(func(t *testing.T, in []byte) {
		addrs, lens, total, err := DecodeRanges(in)
		if err != nil {
			return
		}
		var sum uint64
		for i := range addrs {
			if lens[i] == 0 || addrs[i]+lens[i] < addrs[i] {
				t.Fatalf("accepted range %d (%#x, %d)", i, addrs[i], lens[i])
			}
			sum += lens[i]
		}
		if sum != total || total > MaxPayload || len(addrs) > MaxRanges {
			t.Fatalf("total %d (sum %d) over the limits", total, sum)
		}
	})
}

func FuzzDecodeNotice(f *testing.F) {
	tok := bytes.Repeat([]byte{7}, TokenSize)
	f.Add(EncodeNotice(nil, Notice{Token: tok, ID: 9, Mode: 4, Total: 2, Descs: []NoticeDesc{{4096, 64, 1}, {8192, 64, 2}}}))
	f.Add([]byte("MGN1"))
	f.Fuzz(func(t *testing.T, in []byte) {
		n, err := DecodeNotice(in, 5, nil)
		if err != nil {
			return
		}
		if len(n.Descs) == 0 || len(n.Descs) > MaxNoticeDescs || n.Base+len(n.Descs) > n.Total || n.Total > MaxNoticeTotal || n.Mode >= 5 {
			t.Fatalf("accepted an inconsistent notice: base %d count %d total %d", n.Base, len(n.Descs), n.Total)
		}
		if !bytes.Equal(EncodeNotice(nil, n), in) {
			t.Fatalf("round trip changed the notice")
		}
	})
}
