package core

import (
	"testing"

	"github.com/mcguard/mcguard/verify"
)

// BenchmarkSmallTransfer is one 4 KiB descriptor per transfer, the latency
// path, in each read-back mode and off; allocs/op is the steady state's.
func BenchmarkSmallTransfer(b *testing.B) {
	for _, m := range []verify.Mode{verify.Off, verify.Tail, verify.Sample} {
		b.Run(string(m), func(b *testing.B) {
			src, dst := benchMem(b, 4096), benchMem(b, 4096)
			send, err := Open(mustConfig(b, `{"verify": "`+string(m)+`"}`))
			if err != nil {
				b.Fatal(err)
			}
			defer send.Close()
			recv, err := Open(mustConfig(b, ""))
			if err != nil {
				b.Fatal(err)
			}
			defer recv.Close()
			if err := send.Register(src.addr(0), 4096); err != nil {
				b.Fatal(err)
			}
			if err := recv.Register(dst.addr(0), 4096); err != nil {
				b.Fatal(err)
			}
			descs := []verify.Desc{{Src: src.addr(0), Dst: dst.addr(0), Len: 4096}}
			if _, err := send.Transfer(recv.Endpoint(), descs, TransferOptions{}); err != nil {
				b.Fatal(err)
			}
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if _, err := send.Transfer(recv.Endpoint(), descs, TransferOptions{}); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
