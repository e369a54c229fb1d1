package core

import (
	"bytes"
	"crypto/rand"
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	zmq "github.com/pebbe/zmq4"
	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/core/control"
	"github.com/mcguard/mcguard/core/desc"
	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/core/fault"
	"github.com/mcguard/mcguard/core/wire"
	"github.com/mcguard/mcguard/verify"
)

// matrixCell runs a few transfers under one injected fault and one mode, with the
// receiver settling each as the stress tool does (no sync for off, the
// baseline), and counts successes whose destination differs from the
// source.
// The data plane is "socket" (TCP, bytes through the socket), "same-host"
// (TCP, the target copying them out of the sender), "striped" (TCP over
// three connections, batches large enough to be striped), or "engine" (the
// fault injected at the sender's engine callbacks instead of the target).
func matrixCell(t *testing.T, injected string, mode verify.Mode, plane string) (ok, failed, mismatches int) {
	const n, rounds = 16, 6
	size := 4096
	if plane == "striped" {
		size = 64 << 10 // 1 MiB batches: striped
	}
	sendJS := fmt.Sprintf(`"verify": %q, "max_retries": 15, "retry_sleep_s": 0.001`, mode)
	inject := fmt.Sprintf(`"inject": %q, "inject_rate": 0.3, "inject_lag_max_ms": 5, "inject_seed": 11`, injected)
	var p *pair
	switch plane {
	case "engine":
		p = newEnginePair(t, "{"+sendJS+", "+inject+"}", "", n*size, newFakeEngines())
	case "same-host":
		p = newPair(t, "{"+sendJS+`, "same_host": "required"}`, "{"+inject+"}", n*size)
	case "same-host-mapped":
		p = newMappedPair(t, "{"+sendJS+`, "same_host": "required"}`, "{"+inject+"}", n*size)
	case "striped":
		p = newPair(t, "{"+sendJS+`, "same_host": "off", "tcp_stripes": 3}`, "{"+inject+"}", n*size)
	default:
		p = newPair(t, "{"+sendJS+`, "same_host": "off"}`, "{"+inject+"}", n*size)
	}
	for r := 0; r < rounds; r++ {
		rand.Read(p.src.b)
		if injected == fault.Stale { // the fault's precondition: tails that repeat (zero padding)
			for i := 0; i < n; i++ {
				clear(p.src.b[i*size+size-1024 : (i+1)*size])
			}
		}
		descs := p.blocks(n, size)
		res, err := p.send.Transfer(p.session, descs, TransferOptions{})
		if err == nil {
			switch mode {
			case verify.Off:
			case verify.Digest:
				err = p.recv.SyncTransfers([]uint64{res.ID}, 0)
			default:
				ranges := make([]SyncRange, n)
				for i, d := range descs {
					ranges[i] = SyncRange{d.Dst, d.Len}
				}
				err = p.recv.Sync(ranges, nil, 0)
			}
		}
		if err != nil {
			require.ErrorIs(t, err, errs.Verify, "%s/%s: a fault shows as a verification failure", injected, mode)
			failed++
			time.Sleep(10 * time.Millisecond) // let held writes of the failed round land
			continue
		}
		ok++
		for i := 0; i < n; i++ {
			if !bytes.Equal(p.src.b[i*size:(i+1)*size], p.dst.b[i*size:(i+1)*size]) {
				mismatches++
			}
		}
		time.Sleep(10 * time.Millisecond)
	}
	if plane == "same-host" || plane == "same-host-mapped" { // faults that act on a write at once the sender injects itself, writing into the receiver
		sync := slices.Contains([]string{fault.Drop, fault.Tear, fault.Stale}, injected)
		require.Equal(t, sync, pushed(t, p.send) > 0, "%s: the sender writes into the receiver itself exactly where it can inject the fault", injected)
		require.Equal(t, sync && plane == "same-host-mapped", mapped(t, p.send) > 0, "%s: by memcpy into the receiver's allocation", injected)
	}
	return ok, failed, mismatches
}

func TestDetectionMatrix(t *testing.T) {
	for _, plane := range []string{"socket", "same-host", "same-host-mapped", "striped"} {
		for _, injected := range fault.Delivery {
			for _, mode := range verify.Modes {
				t.Run(plane+"/"+injected+"/"+string(mode), func(t *testing.T) {
					t.Parallel()
					detectionCell(t, plane, injected, mode)
				})
			}
		}
	}
}

func detectionCell(t *testing.T, plane, injected string, mode verify.Mode) {
	ok, failed, mismatches := matrixCell(t, injected, mode, plane)
	t.Logf("ok %d failed %d mismatches %d", ok, failed, mismatches)
	switch {
	case mode == verify.Off:
		require.Positive(t, mismatches, "off must show the fault")
	case mode == verify.Tail && injected == fault.Stale:
		require.Positive(t, mismatches, "tail's blind spot: a lost write whose tail already matched")
	default:
		require.Zero(t, mismatches, "no success may hold wrong bytes")
	}
}

// TestDetectionMatrixOverAnEngine injects the faults where an engine's
// "complete" is not "delivered": at its callbacks (stale needs the
// destination's bytes, which callbacks do not see).
func TestDetectionMatrixOverAnEngine(t *testing.T) {
	for _, injected := range []string{fault.Lag, fault.Drop, fault.Tear, fault.Reorder, fault.Hold} {
		for _, mode := range verify.Modes {
			t.Run(injected+"/"+string(mode), func(t *testing.T) {
				t.Parallel()
				ok, failed, mismatches := matrixCell(t, injected, mode, "engine")
				t.Logf("ok %d failed %d mismatches %d", ok, failed, mismatches)
				if mode == verify.Off {
					require.Positive(t, mismatches, "off must show the fault")
				} else {
					require.Zero(t, mismatches, "no success may hold wrong bytes")
				}
			})
		}
	}
}

func TestSyncComparesDigests(t *testing.T) {
	p := newPair(t, `{"verify": "digest", "notify": "never"}`, "", 8*4096)
	fill(p.src.b)
	descs := p.blocks(8, 4096)
	digests := make([]uint64, len(descs))
	_, err := p.send.Transfer(p.recv.Endpoint(), descs, TransferOptions{Digests: digests})
	require.NoError(t, err)
	require.Equal(t, desc.DigestOf(p.src.b[:4096]), digests[0])
	ranges := make([]SyncRange, len(descs))
	for i, d := range descs {
		ranges[i] = SyncRange{d.Dst, d.Len}
	}
	require.NoError(t, p.recv.Sync(ranges, digests, 0), "the application-told path")
	require.NoError(t, p.recv.Sync(ranges, nil, 0), "without digests: settle only")
	p.dst.b[5*4096+77] ^= 0xff
	err = p.recv.Sync(ranges, digests, 0)
	require.ErrorIs(t, err, errs.Verify)
	require.Contains(t, err.Error(), "range 5 [")
	require.ErrorIs(t, p.recv.Sync(ranges, digests[:3], 0), errs.InvalidArg)
}

func TestSyncTransfersByNotice(t *testing.T) {
	// digest_at "sync": the byte flipped below stands for one that landed
	// wrong, which only a sync that reads memory sees here (landed_test.go
	// covers digests taken as bytes land).
	p := newPair(t, `{"verify": "digest"}`, `{"digest_at": "sync"}`, 600*256)
	fill(p.src.b)
	res, err := p.send.Transfer(p.recv.Endpoint(), p.blocks(600, 256), TransferOptions{})
	require.NoError(t, err, "600 descriptors: two chunks, two notices")
	require.EqualValues(t, 2, stats(t, p.send)["notices_sent"])
	require.NoError(t, p.recv.SyncTransfers([]uint64{res.ID}, 0))
	require.True(t, bytes.Equal(p.src.b, p.dst.b))

	res, err = p.send.Transfer(p.recv.Endpoint(), p.blocks(4, 256), TransferOptions{})
	require.NoError(t, err)
	p.dst.b[300] ^= 1
	err = p.recv.SyncTransfers([]uint64{res.ID}, 0)
	require.ErrorIs(t, err, errs.Verify)
	require.Contains(t, err.Error(), fmt.Sprintf("transfer %#x descriptor 1", res.ID))
}

func TestSyncWithoutNoticeTimesOut(t *testing.T) {
	g := openGuard(t, `{"sync_timeout_ms": 100}`)
	start := time.Now()
	err := g.SyncTransfers([]uint64{12345}, 0)
	require.ErrorIs(t, err, errs.Timeout)
	require.Contains(t, err.Error(), "no complete notice for transfer 0x3039")
	require.Less(t, time.Since(start), time.Second)
	require.ErrorIs(t, g.SyncTransfers(nil, 0), errs.InvalidArg)
}

// sendRaw sends body to a guard's control endpoint and returns the reply.
func sendRaw(t *testing.T, endpoint string, body []byte) string {
	zctx, err := zmq.NewContext()
	require.NoError(t, err)
	defer zctx.Term()
	sock, _, err := control.NewReqSocket(t.Context(), zctx, endpoint, time.Second)
	require.NoError(t, err)
	defer sock.Close()
	raw, err := control.Request(t.Context(), sock, endpoint, "test", body, 2*time.Second)
	require.NoError(t, err)
	return string(raw)
}

func TestMalformedNoticesAreRefused(t *testing.T) {
	g := openGuard(t, `{"sync_timeout_ms": 100}`)
	m := newMem(t, 4096)
	require.NoError(t, g.Register(m.addr(0), 4096))
	zctx, err := zmq.NewContext()
	require.NoError(t, err)
	defer zctx.Term()
	hello, err := control.Handshake(t.Context(), zctx, g.Endpoint(), time.Second, nil, control.Hello{Transport: "tcp"})
	require.NoError(t, err)
	signer := &session{hello: hello} // signs as the session of that handshake would
	good := wire.Notice{ID: 7, Mode: 4, Total: 1, Descs: []wire.NoticeDesc{{Dst: m.addr(0), Len: 64, Digest: 1}}}
	stranger := &session{hello: control.HelloReply{Token: make([]byte, wire.TokenSize), Key: make([]byte, 32)}}
	badMAC := signer.signNotice(good)
	badMAC[wire.NoticeMACOffset] ^= 1
	cases := map[string][]byte{
		"no handshake":   stranger.signNotice(good),
		"bad MAC":        badMAC,
		"unsigned":       wire.EncodeNotice(nil, wire.Notice{Token: hello.Token, Seq: 99, ID: 7, Mode: 4, Total: 1, Descs: good.Descs}),
		"truncated":      signer.signNotice(good)[:40],
		"bad mode":       signer.signNotice(wire.Notice{ID: 7, Mode: 99, Total: 1, Descs: good.Descs}),
		"beyond total":   signer.signNotice(wire.Notice{ID: 7, Mode: 4, Total: 1, Base: 1, Descs: good.Descs}),
		"unregistered":   signer.signNotice(wire.Notice{ID: 7, Mode: 4, Total: 1, Descs: []wire.NoticeDesc{{Dst: m.addr(0) + 8192, Len: 8}}}),
		"not first":      signer.signNotice(wire.Notice{ID: 7, Mode: 4, Total: 2, Base: 1, Descs: good.Descs}),
		"garbage":        []byte("MGN2 but nothing after it, or rather too little"),
		"not json":       []byte("{nope"),
		"wrong protocol": []byte(`{"proto": 99, "op": "hello"}`),
	}
	for name, body := range cases {
		rep := sendRaw(t, g.Endpoint(), body)
		require.Contains(t, rep, `"error"`, name)
	}
	require.EqualValues(t, 0, stats(t, g)["notices_received"], "nothing was recorded")
	require.ErrorIs(t, g.SyncTransfers([]uint64{7}, 0), errs.Timeout)
	// The well-formed one is taken, and its wrong digest shows at sync;
	// the same bytes again are a replay.
	signed := signer.signNotice(good)
	require.Contains(t, sendRaw(t, g.Endpoint(), signed), fmt.Sprintf(`"proto":%d}`, control.ProtocolVersion))
	require.Contains(t, sendRaw(t, g.Endpoint(), signed), "a replay")
	err = g.SyncTransfers([]uint64{7}, 0)
	require.True(t, errors.Is(err, errs.Verify), "%v", err)
}
