package core

import (
	"testing"
	"unsafe"

	"github.com/mcguard/mcguard/core/desc"
	"github.com/mcguard/mcguard/core/transport/engine"
)

// BenchmarkEngineSmallTransfer measures the guard's own path over an
// engine: one 4 KiB transfer over an engine that copies the bytes in
// this process and returns, called inline, per mode.
//
//	go test -run '^$' -bench EngineSmallTransfer ./core/
func BenchmarkEngineSmallTransfer(b *testing.B) {
	for _, mode := range []string{"off", "tail", "digest"} {
		b.Run(mode, func(b *testing.B) {
			copyBytes := func(_ string, to, from, n []uint64) error {
				for i := range n {
					copy(unsafe.Slice((*byte)(unsafe.Pointer(uintptr(to[i]))), n[i]),
						unsafe.Slice((*byte)(unsafe.Pointer(uintptr(from[i]))), n[i]))
				}
				return nil
			}
			ops := engine.Ops{Name: "copy",
				Write: func(s string, local, remote, n []uint64) error { return copyBytes(s, remote, local, n) },
				Read:  func(s string, local, remote, n []uint64) error { return copyBytes(s, local, remote, n) },
			}
			send, err := OpenWithEngine(mustConfig(b, `{"verify": "`+mode+`", "engine_inline_calls": true}`), ops)
			mustNoErr(b, err)
			recv := openBench(b, `{}`)
			b.Cleanup(func() { send.Close(); recv.Close() })
			src, dst := benchMem(b, 4096), benchMem(b, 4096)
			mustNoErr(b, send.Register(src.addr(0), 4096))
			mustNoErr(b, recv.Register(dst.addr(0), 4096))
			mustNoErr(b, send.SetPeerGuard("decode:1", recv.Endpoint()))
			d := []desc.Desc{{Src: src.addr(0), Dst: dst.addr(0), Len: 4096}}
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				_, err := send.Transfer("decode:1", d, TransferOptions{})
				mustNoErr(b, err)
			}
		})
	}
}
