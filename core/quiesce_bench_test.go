package core

import (
	"sort"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mcguard/mcguard/core/desc"
	"github.com/mcguard/mcguard/core/internal/models"
)

// BenchmarkQuiesce measures what a quiesce costs: its own time with no
// traffic and while another session moves 64 x 256 KiB batches into other
// ranges of the same receiver, and that session's throughput with a
// quiesce every 10 ms against without (TCP); and on the NIC model its time
// with no traffic (the regions registered again).
//
//	go test -run '^$' -bench Quiesce -benchtime 1x ./core/
func BenchmarkQuiesce(b *testing.B) {
	const n, size = 64, 256 << 10
	for i := 0; i < b.N; i++ {
		src, dst, spare := benchMem(b, n*size), benchMem(b, n*size), benchMem(b, 1<<20)
		send, recv := openBench(b, `{"verify": "off"}`), openBench(b, "")
		mustNoErr(b, send.Register(src.addr(0), n*size))
		mustNoErr(b, recv.Register(dst.addr(0), n*size))
		mustNoErr(b, recv.Register(spare.addr(0), 1<<20))
		descs := make([]desc.Desc, n)
		for k := range descs {
			descs[k] = desc.Desc{Src: src.addr(k * size), Dst: dst.addr(k * size), Len: size}
		}
		ranges := []SyncRange{{spare.addr(0), 1 << 20}}
		quiesceTimes := func(k int) []time.Duration {
			var out []time.Duration
			for j := 0; j < k; j++ {
				start := time.Now()
				mustNoErr(b, recv.Quiesce(ranges))
				out = append(out, time.Since(start))
				time.Sleep(10 * time.Millisecond)
			}
			return out
		}
		throughput := func(withQuiesces bool) (float64, []time.Duration) {
			var moved atomic.Int64
			stop := make(chan struct{})
			var wg sync.WaitGroup
			wg.Go(func() {
				for {
					select {
					case <-stop:
						return
					default:
					}
					if _, err := send.Transfer(recv.Endpoint(), descs, TransferOptions{}); err == nil {
						moved.Add(n * size)
					}
				}
			})
			start := time.Now()
			var times []time.Duration
			if withQuiesces {
				times = quiesceTimes(100)
			} else {
				time.Sleep(time.Second)
			}
			close(stop)
			wg.Wait()
			return float64(moved.Load()) / time.Since(start).Seconds() / 1e9, times
		}
		idle := quiesceTimes(100)
		plain, _ := throughput(false)
		busy, busyTimes := throughput(true)
		b.ReportMetric(median(idle).Seconds()*1e6, "idle_quiesce_us")
		b.ReportMetric(median(busyTimes).Seconds()*1e6, "busy_quiesce_us")
		b.ReportMetric(busy/plain, "throughput_with/without")
		send.Close()
		recv.Close()

		nic := models.NICFor(b)
		rs := openBench(b, `{"transport": "rdma", "verbs_library": "`+nic+`"}`)
		m := benchMem(b, 64<<20)
		mustNoErr(b, rs.Register(m.addr(0), 64<<20))
		var rdmaTimes []time.Duration
		for j := 0; j < 20; j++ {
			start := time.Now()
			mustNoErr(b, rs.Quiesce([]SyncRange{{m.addr(0), 4096}}))
			rdmaTimes = append(rdmaTimes, time.Since(start))
		}
		b.ReportMetric(median(rdmaTimes).Seconds()*1e6, "rdma_model_quiesce_64MiB_us")
		rs.Close()
	}
}

func median(d []time.Duration) time.Duration {
	s := append([]time.Duration(nil), d...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	return s[len(s)/2]
}
