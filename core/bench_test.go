package core

import (
	"fmt"
	"io"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/core/desc"
	"github.com/mcguard/mcguard/core/internal/models"
	"github.com/mcguard/mcguard/verify"
)

// BenchmarkModes moves 64 descriptors x 256 KiB per batch (and over the
// socket, 4096 x 4 KiB: one cache block each, per-write costs) in each
// verification mode (digest with the receiver's sync included): over the
// socket beside a raw TCP socket pair, and on one host (the sender writing
// into the receiver: registered memory by process_vm_writev, allocated
// memory by memcpy) beside a single-threaded memcpy of the same bytes,
// alternating batch by batch so that every figure sees the same machine
// load. It reports GB/s for the baseline and off, and each mode's
// throughput divided by off's; at 4096 x 4 KiB (eight chunks) also tail's
// and sample's with no chunk's writes posted during the check of the one
// before (tail_unpipelined/off).
func BenchmarkModes(b *testing.B) {
	b.Run("socket", func(b *testing.B) { benchModes(b, `"same_host": "off"`, "raw", false, 64, 256<<10) })
	b.Run("socket-4KiB", func(b *testing.B) { benchModes(b, `"same_host": "off"`, "raw", false, 4096, 4<<10) })
	b.Run("same-host", func(b *testing.B) { benchModes(b, `"same_host": "required"`, "memcpy", false, 64, 256<<10) })
	b.Run("same-host-mapped", func(b *testing.B) { benchModes(b, `"same_host": "required"`, "memcpy", true, 64, 256<<10) })
}

func benchModes(b *testing.B, plane, baseline string, mapped bool, n, size int) {
	send, recv, src, dst := benchPair(b, `{"verify": "off", `+plane+`}`, n*size, mapped)
	descs := make([]desc.Desc, n)
	for i := range descs {
		descs[i] = desc.Desc{Src: src.addr(i * size), Dst: dst.addr(i * size), Len: uint64(size)}
	}
	raw := newRawPair(b, n*size)
	defer raw.close()
	copyAll := func() {
		if baseline == "raw" {
			raw.batch(b, src.b)
			return
		}
		for i := range descs {
			copy(dst.b[i*size:(i+1)*size], src.b[i*size:(i+1)*size])
		}
	}

	spent := map[string]time.Duration{}
	b.SetBytes(int64(n * size))
	b.ResetTimer()
	// Each iteration runs the modes and the baseline once, starting one
	// further along each time: none always follows the same one (off
	// always ran right after the baseline, and came out slower than tail).
	steps := len(verify.Modes) + 1
	if n > 512 { // several chunks (max_batch): tail and sample once more, posting no chunk ahead
		steps += 2
	}
	for i := 0; i < b.N; i++ {
		for k := 0; k < steps; k++ {
			j := (i + k) % steps
			start := time.Now()
			if j == len(verify.Modes) {
				copyAll()
				spent[baseline] += time.Since(start)
				continue
			}
			if j > len(verify.Modes) { // tail and sample with no chunk posted ahead
				m := verify.Tail
				if j == len(verify.Modes)+2 {
					m = verify.Sample
				}
				send.cfg.PostAhead = false
				_, err := send.Transfer(recv.Endpoint(), descs, TransferOptions{Verify: &m})
				send.cfg.PostAhead = true
				if err != nil {
					b.Fatal(err)
				}
				spent[string(m)+"_unpipelined"] += time.Since(start)
				continue
			}
			m := verify.Modes[j]
			res, err := send.Transfer(recv.Endpoint(), descs, TransferOptions{Verify: &m})
			if err != nil {
				b.Fatal(err)
			}
			if m == verify.Digest { // the receiver's half, timed on its own too
				spent["digest_send"] += time.Since(start)
				if err := recv.SyncTransfers([]uint64{res.ID}, 0); err != nil {
					b.Fatal(err)
				}
			}
			spent[string(m)] += time.Since(start)
		}
	}
	b.StopTimer()
	gbs := func(k string) float64 { return float64(b.N) * float64(n*size) / spent[k].Seconds() / 1e9 }
	b.ReportMetric(gbs(baseline), baseline+"_GB/s")
	b.ReportMetric(gbs("off"), "off_GB/s")
	for _, m := range verify.Modes[1:] {
		b.ReportMetric(gbs(string(m))/gbs("off"), string(m)+"/off")
	}
	b.ReportMetric(gbs("digest_send")/gbs("off"), "digest_send/off")
	if spent["tail_unpipelined"] > 0 {
		b.ReportMetric(gbs("tail_unpipelined")/gbs("off"), "tail_unpipelined/off")
		b.ReportMetric(gbs("sample_unpipelined")/gbs("off"), "sample_unpipelined/off")
	}
	b.ReportMetric(gbs("off")/gbs(baseline), "off/"+baseline)
}

// benchPair opens a sender (sendJS) and a receiver with size bytes
// registered on each (the receiver's from its Alloc where mapped); both
// close when the benchmark ends.
func benchPair(b *testing.B, sendJS string, size int, mapped bool) (send, recv *Guard, src, dst *mem) {
	src = benchMem(b, size)
	send, recv = openBench(b, sendJS), openBench(b, "")
	b.Cleanup(func() { send.Close(); recv.Close() })
	mustNoErr(b, send.Register(src.addr(0), uint64(size)))
	if mapped {
		dst = allocated(b, recv, size)
	} else {
		dst = benchMem(b, size)
		mustNoErr(b, recv.Register(dst.addr(0), uint64(size)))
	}
	return send, recv, src, dst
}

func openBench(b *testing.B, js string) *Guard {
	g, err := Open(mustConfig(b, js))
	mustNoErr(b, err)
	return g
}

func mustNoErr(b *testing.B, err error) {
	if err != nil {
		b.Fatal(err)
	}
}

// BenchmarkSmallTransfer is one 4 KiB descriptor per transfer, the latency
// path, in each read-back mode and off; allocs/op is the steady state's.
func BenchmarkSmallTransfer(b *testing.B) {
	b.Run("raw-socket", func(b *testing.B) { // the floor: one 4 KiB write and a one-byte answer
		p := newRawPair(b, 4096)
		defer p.close()
		data := make([]byte, 4096)
		b.ResetTimer()
		for i := 0; i < b.N; i++ {
			p.batch(b, data)
		}
	})
	for _, plane := range []string{"socket", "same-host"} {
		for _, m := range []verify.Mode{verify.Off, verify.Tail, verify.Sample, verify.Digest} {
			b.Run(plane+"/"+string(m), func(b *testing.B) { benchSmall(b, plane, m, true) })
		}
		b.Run(plane+"/digest-sender", func(b *testing.B) { benchSmall(b, plane, verify.Digest, false) })
	}
}

// benchSmall times 1 x 4 KiB transfers in mode m, over the socket or on
// one host (the sender writing into the receiver); in digest mode with
// sync each transfer includes the receiver's sync of it.
func benchSmall(b *testing.B, plane string, m verify.Mode, sync bool) {
	sameHost := map[string]string{"socket": "off", "same-host": "required"}[plane]
	send, recv, src, dst := benchPair(b, `{"verify": "`+string(m)+`", "same_host": "`+sameHost+`"}`, 4096, false)
	descs := []desc.Desc{{Src: src.addr(0), Dst: dst.addr(0), Len: 4096}}
	ids := make([]uint64, 1)
	transfer := func() {
		res, err := send.Transfer(recv.Endpoint(), descs, TransferOptions{})
		if err != nil {
			b.Fatal(err)
		}
		if m == verify.Digest && sync {
			ids[0] = res.ID
			if err := recv.SyncTransfers(ids, 0); err != nil {
				b.Fatal(err)
			}
		}
	}
	transfer()
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		transfer()
	}
}

func mustConfig(b *testing.B, js string) Config {
	c, err := LoadConfig(nil, js)
	if err != nil {
		b.Fatal(err)
	}
	return c
}

func benchMem(b *testing.B, n int) *mem {
	return newMem(b, n)
}

// rawPair is the baseline: one TCP connection on loopback, the batch's
// bytes written whole, and a one-byte acknowledgement after the reader
// has them all.
type rawPair struct {
	w, r net.Conn
	done chan struct{}
}

func newRawPair(b *testing.B, batch int) *rawPair {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	defer ln.Close()
	p := &rawPair{done: make(chan struct{})}
	accepted := make(chan error, 1)
	go func() {
		c, err := ln.Accept()
		accepted <- err
		if err != nil {
			close(p.done)
			return
		}
		p.r = c
		buf := make([]byte, batch)
		for {
			if _, err := io.ReadFull(c, buf); err != nil {
				close(p.done)
				return
			}
			if _, err := c.Write([]byte{1}); err != nil {
				close(p.done)
				return
			}
		}
	}()
	if p.w, err = net.Dial("tcp", ln.Addr().String()); err != nil {
		b.Fatal(err)
	}
	// Accepted before the listener closes (the deferred Close): a
	// connection still in its backlog would be reset, and the baseline
	// would time failing writes.
	if err := <-accepted; err != nil {
		b.Fatal(err)
	}
	return p
}

func (p *rawPair) batch(b *testing.B, data []byte) {
	var ack [1]byte
	if _, err := p.w.Write(data); err != nil {
		b.Fatal(err)
	}
	if _, err := io.ReadFull(p.w, ack[:]); err != nil {
		b.Fatal(err)
	}
}

func (p *rawPair) close() {
	p.w.Close()
	<-p.done
	if p.r != nil {
		p.r.Close()
	}
}

// BenchmarkRDMAModelStripes moves 64 descriptors x 256 KiB per batch over
// the software NIC (tests/nicmodel) with one queue pair and with four, in
// off, tail and digest (the fence alone), alternating batch by batch. The
// model's fabric is a Unix socket per queue pair, so this measures the
// transport's own work and what striping does on a multi-core host, not
// a NIC. It reports GB/s for one queue pair in off, and each
// configuration against one queue pair in the same mode.
func BenchmarkRDMAModelStripes(b *testing.B) {
	nic := models.NICFor(b)
	const n, size = 64, 256 << 10
	src, dst := benchMem(b, n*size), benchMem(b, n*size)
	recv, err := Open(mustConfig(b, fmt.Sprintf(`{"transport": "rdma", "verbs_library": %q}`, nic)))
	if err != nil {
		b.Fatal(err)
	}
	defer recv.Close()
	if err := recv.Register(dst.addr(0), n*size); err != nil {
		b.Fatal(err)
	}
	senders := map[int]*Guard{}
	for _, qps := range []int{1, 4} {
		g, err := Open(mustConfig(b, fmt.Sprintf(`{"transport": "rdma", "verbs_library": %q, "rdma_qps": %d}`, nic, qps)))
		if err != nil {
			b.Fatal(err)
		}
		defer g.Close()
		if err := g.Register(src.addr(0), n*size); err != nil {
			b.Fatal(err)
		}
		senders[qps] = g
	}
	descs := make([]desc.Desc, n)
	for i := range descs {
		descs[i] = desc.Desc{Src: src.addr(i * size), Dst: dst.addr(i * size), Len: size}
	}
	modes := []verify.Mode{verify.Off, verify.Tail, verify.Digest}
	spent := map[string]time.Duration{}
	b.SetBytes(int64(n * size))
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		for _, m := range modes {
			for _, qps := range []int{1, 4} {
				start := time.Now()
				if _, err := senders[qps].Transfer(recv.Endpoint(), descs, TransferOptions{Verify: &m, NoNotice: true}); err != nil {
					b.Fatal(err)
				}
				spent[fmt.Sprintf("%s_qp%d", m, qps)] += time.Since(start)
			}
		}
	}
	b.StopTimer()
	gbs := func(k string) float64 { return float64(b.N) * n * size / spent[k].Seconds() / 1e9 }
	b.ReportMetric(gbs("off_qp1"), "off_qp1_GB/s")
	for _, m := range modes {
		b.ReportMetric(gbs(string(m)+"_qp4")/gbs(string(m)+"_qp1"), string(m)+"_qp4/qp1")
	}
	b.ReportMetric(gbs("tail_qp1")/gbs("off_qp1"), "tail/off_qp1")
	b.ReportMetric(gbs("digest_qp1")/gbs("off_qp1"), "digest/off_qp1")
}

// A small transfer allocates nothing in steady state, in off, the
// read-back modes and digest with the receiver's sync (digest_at "sync":
// the notice, its store and the sync's scratch are reused), over the
// socket and on one host (both ends counted: they share this process). Averaged over many transfers, so a stray
// allocation elsewhere (a timer, the collector) does not fail it.
func TestSmallTransferAllocatesNothing(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector allocates for its own bookkeeping; make test also runs this without it")
	}
	for _, plane := range []string{"off", "required", "mapped"} {
		for _, mode := range []string{"off", "tail", "sample", "digest"} {
			t.Run("same_host "+plane+"/"+mode, func(t *testing.T) {
				var p *pair
				if plane == "mapped" { // the receiver's memory from Alloc: memcpy
					p = newMappedPair(t, `{"verify": "`+mode+`", "same_host": "required"}`, "", 4096)
				} else {
					p = newPair(t, `{"verify": "`+mode+`", "same_host": "`+plane+`"}`, "", 4096)
				}
				descs := p.blocks(1, 4096)
				transfer := func() {
					res, err := p.send.Transfer(p.session, descs, TransferOptions{})
					if err != nil {
						t.Fatal(err)
					}
					if mode == "digest" { // the receiver's half too: its notice and sync
						if err := p.recv.SyncTransfers([]uint64{res.ID}, 0); err != nil {
							t.Fatal(err)
						}
					}
				}
				for i := 0; i < 50; i++ {
					transfer()
				}
				allocs := testing.AllocsPerRun(300, transfer)
				require.LessOrEqual(t, allocs, 1.0, "allocations per transfer")
			})
		}
	}
}
