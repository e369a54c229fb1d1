package core

import (
	"testing"
	"time"

	"github.com/mcguard/mcguard/core/desc"
	"github.com/mcguard/mcguard/verify"
)

// BenchmarkAuthenticatedReplies is what tagging the replies verification
// rests on costs (guards that share a secret): the same transfers over the
// socket with and without a secret, alternating batch by batch, in tail,
// full and digest (with the receiver's sync), at 64 x 256 KiB and at
// 1 x 4 KiB. It reports each mode's time with a secret divided by its time
// without.
func BenchmarkAuthenticatedReplies(b *testing.B) {
	for _, shape := range []struct {
		name    string
		n, size int
	}{{"64x256KiB", 64, 256 << 10}, {"1x4KiB", 1, 4 << 10}} {
		b.Run(shape.name, func(b *testing.B) {
			type side struct {
				send, recv *Guard
				descs      []desc.Desc
			}
			open := func(secret string) side {
				src := benchMem(b, shape.n*shape.size)
				dst := benchMem(b, shape.n*shape.size)
				s := side{send: openBench(b, `{"same_host": "off"`+secret+`}`), recv: openBench(b, `{"same_host": "off"`+secret+`}`)}
				b.Cleanup(func() { s.send.Close(); s.recv.Close() })
				mustNoErr(b, s.send.Register(src.addr(0), uint64(shape.n*shape.size)))
				mustNoErr(b, s.recv.Register(dst.addr(0), uint64(shape.n*shape.size)))
				for i := 0; i < shape.n; i++ {
					s.descs = append(s.descs, desc.Desc{Src: src.addr(i * shape.size), Dst: dst.addr(i * shape.size), Len: uint64(shape.size)})
				}
				return s
			}
			sides := map[bool]side{false: open(""), true: open(`, "secret": "correct horse battery staple"`)}
			modes := []verify.Mode{verify.Tail, verify.Full, verify.Digest}
			spent := map[verify.Mode]map[bool]time.Duration{}
			for _, m := range modes {
				spent[m] = map[bool]time.Duration{}
			}
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				for _, m := range modes {
					for _, secret := range []bool{i%2 == 0, i%2 != 0} {
						s := sides[secret]
						start := time.Now()
						res, err := s.send.Transfer(s.recv.Endpoint(), s.descs, TransferOptions{Verify: ptr(m)})
						mustNoErr(b, err)
						if m == verify.Digest {
							mustNoErr(b, s.recv.SyncTransfers([]uint64{res.ID}, 0))
						}
						spent[m][secret] += time.Since(start)
					}
				}
			}
			for _, m := range modes {
				b.ReportMetric(float64(spent[m][true])/float64(spent[m][false]), string(m)+"_secret/plain")
			}
		})
	}
}
