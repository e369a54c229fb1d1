package core

import (
	"sort"
	"testing"
	"time"

	"github.com/mcguard/mcguard/core/desc"
	"github.com/mcguard/mcguard/verify"
)

// BenchmarkSyncAfterAPause measures the receiver's sync of one 4 KiB
// digest transfer (digest_at "sync": the notice taken, the landed bytes
// digested and compared) right after the transfer, and after a pause of
// 200 µs in which this process does nothing, as a receiver that waits for
// the sender's "done" message does: the same work, its code and data gone
// cold meanwhile. Medians of b.N syncs each, on one host (the notice in
// the ring the sender writes) and over sockets (the notice on the
// connection, taken before the writes were answered).
//
//	go test -run '^$' -bench SyncAfterAPause -benchtime 2000x ./core/
func BenchmarkSyncAfterAPause(b *testing.B) {
	b.Run("one-host", func(b *testing.B) { benchSyncAfterAPause(b, `"same_host": "required"`) })
	b.Run("socket", func(b *testing.B) { benchSyncAfterAPause(b, `"same_host": "off"`) })
}

func benchSyncAfterAPause(b *testing.B, plane string) {
	send, recv := openBench(b, `{"verify": "digest", `+plane+`}`), openBench(b, `{"digest_at": "sync"}`)
	b.Cleanup(func() { send.Close(); recv.Close() })
	src, dst := benchMem(b, 4096), benchMem(b, 4096)
	mustNoErr(b, send.Register(src.addr(0), 4096))
	mustNoErr(b, recv.Register(dst.addr(0), 4096))
	d := []desc.Desc{{Src: src.addr(0), Dst: dst.addr(0), Len: 4096}}
	m := verify.Digest
	for _, pause := range []time.Duration{0, 200 * time.Microsecond} {
		took := make([]time.Duration, 0, b.N)
		for i := 0; i < b.N; i++ {
			res, err := send.Transfer(recv.Endpoint(), d, TransferOptions{Verify: &m})
			mustNoErr(b, err)
			if pause > 0 {
				time.Sleep(pause)
			}
			start := time.Now()
			mustNoErr(b, recv.SyncTransfers([]uint64{res.ID}, 0))
			took = append(took, time.Since(start))
		}
		sort.Slice(took, func(i, j int) bool { return took[i] < took[j] })
		name := "sync_ns"
		if pause > 0 {
			name = "sync_after_pause_ns"
		}
		b.ReportMetric(float64(took[len(took)/2].Nanoseconds()), name)
	}
	b.ReportMetric(0, "ns/op") // the syncs' medians above are the figures
}
