package core

import (
	"encoding/json"
	"testing"
	"unsafe"

	"github.com/mcguard/mcguard/core/desc"
	"github.com/mcguard/mcguard/core/transport/engine"
)

// copyingEngine is an engine that copies the bytes within this process
// and returns: what is left of a transfer's time is the guard's.
func copyingEngine() engine.Ops {
	move := func(to, from, n []uint64) error {
		for i := range n {
			copy(unsafe.Slice((*byte)(unsafe.Pointer(uintptr(to[i]))), n[i]),
				unsafe.Slice((*byte)(unsafe.Pointer(uintptr(from[i]))), n[i]))
		}
		return nil
	}
	return engine.Ops{Name: "copy",
		Write: func(_ string, local, remote, n []uint64) error { return move(remote, local, n) },
		Read:  func(_ string, local, remote, n []uint64) error { return move(local, remote, n) },
	}
}

// benchEngine opens a guard over copyingEngine (calls inline) in mode,
// and a receiving guard it knows as the peer's ("decode:1"), with size
// bytes registered on each side.
func benchEngine(b *testing.B, mode string, size int, mapped bool) (send *Guard, src, dst *mem) {
	send, err := OpenWithEngine(mustConfig(b, `{"verify": "`+mode+`", "engine_inline_calls": true}`), copyingEngine())
	mustNoErr(b, err)
	recv := openBench(b, `{}`)
	b.Cleanup(func() { send.Close(); recv.Close() })
	src = benchMem(b, size)
	mustNoErr(b, send.Register(src.addr(0), uint64(size)))
	if mapped { // the receiver's own allocation, which the sender maps: read back by memcpy
		dst = allocated(b, recv, size)
	} else {
		dst = benchMem(b, size)
		mustNoErr(b, recv.Register(dst.addr(0), uint64(size)))
	}
	mustNoErr(b, send.SetPeerGuard("decode:1", recv.Endpoint()))
	return send, src, dst
}

// BenchmarkEngineSmallTransfer measures the guard's own path over an
// engine: one 4 KiB transfer, per mode.
//
//	go test -run '^$' -bench EngineSmallTransfer ./core/
func BenchmarkEngineSmallTransfer(b *testing.B) {
	for _, mode := range []string{"off", "tail", "digest"} {
		b.Run(mode, func(b *testing.B) {
			send, src, dst := benchEngine(b, mode, 4096, false)
			d := []desc.Desc{{Src: src.addr(0), Dst: dst.addr(0), Len: 4096}}
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				_, err := send.Transfer("decode:1", d, TransferOptions{})
				mustNoErr(b, err)
			}
		})
	}
}

// BenchmarkEngineScatteredBlocks is 4096 blocks of 4 KiB, none next to
// another at the receiver (so nothing is joined), per read-back mode;
// check_us is the checks' share of a transfer: the receiver's guard is
// on this host, so they read its memory with process_vm_readv, or by
// memcpy where it is the receiver's own allocation (/mapped).
//
//	go test -run '^$' -bench EngineScatteredBlocks -benchtime 100x ./core/
func BenchmarkEngineScatteredBlocks(b *testing.B) {
	const n, size = 4096, 4096
	for _, c := range []struct {
		mode   string
		mapped bool
	}{{"tail", false}, {"sample", false}, {"tail", true}, {"sample", true}} {
		name := c.mode
		if c.mapped {
			name += "/mapped"
		}
		b.Run(name, func(b *testing.B) {
			send, src, dst := benchEngine(b, c.mode, n*size, c.mapped)
			d := make([]desc.Desc, n)
			for i := range d {
				j := i * 2654435761 % n // a fixed shuffle: 2654435761 is odd, so every block once
				d[i] = desc.Desc{Src: src.addr(i * size), Dst: dst.addr(j * size), Len: size}
			}
			checks := func() float64 {
				js, err := send.Stats()
				mustNoErr(b, err)
				var st struct {
					CheckNS float64 `json:"check_ns"`
				}
				mustNoErr(b, json.Unmarshal(js, &st))
				return st.CheckNS
			}
			before := checks()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				_, err := send.Transfer("decode:1", d, TransferOptions{})
				mustNoErr(b, err)
			}
			b.ReportMetric((checks()-before)/float64(b.N)/1e3, "check_us")
		})
	}
}
