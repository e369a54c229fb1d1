package core

import (
	"encoding/json"
	"errors"
	"testing"

	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/core/wire"
)

// FuzzControlRequest feeds arbitrary bytes to a guard's control handler,
// as a peer on the control port could: handshake steps and notices alike.
// Every request gets a JSON reply, and nothing is recorded from one that
// could not have come from a peer that shook hands.
func FuzzControlRequest(f *testing.F) {
	f.Add([]byte(`{"proto":5,"op":"hello","nonce":"AAAAAAAAAAAAAAAAAAAAAA==","transport":"tcp"}`))
	f.Add([]byte(`{"proto":5,"op":"auth","nonce":"AAAAAAAAAAAAAAAAAAAAAA==","challenge":"AAAAAAAAAAAAAAAAAAAAAA==","mac":"AA==","transport":"tcp"}`))
	f.Add(wire.EncodeNotice(nil, wire.Notice{Token: make([]byte, 16), ID: 1, Mode: 4, Total: 1, Descs: []wire.NoticeDesc{{Dst: 4096, Len: 8}}}))
	f.Add([]byte(`{"proto":5,"op":"hello","nonce":null,"extra":1}`))
	f.Add([]byte(`{"proto":5,"op":"hello","nonce":"AAAAAAAAAAAAAAAAAAAAAA==","transport":"rdma","offer":{"qps":[{"qpn":1,"psn":2},{}]}}`))
	f.Add([]byte(`{"proto":5,"op":"hello","nonce":"AAAAAAAAAAAAAAAAAAAAAA==","transport":"tcp","offer":[1,2]}`))
	g, err := Open(mustLoad(f, ""))
	if err != nil {
		f.Fatal(err)
	}
	defer g.Close()
	f.Fuzz(func(t *testing.T, in []byte) {
		var out []byte
		if wire.IsNotice(in) {
			out = g.receiveNotice(in)
		} else {
			out = g.answerHandshake([]byte("fuzzer"), in)
		}
		var rep map[string]any
		if err := json.Unmarshal(out, &rep); err != nil {
			t.Fatalf("reply is not JSON: %q", out)
		}
		if n := g.stats.noticesReceived.Load(); n != 0 {
			t.Fatalf("recorded a notice from a peer that never shook hands")
		}
	})
}

func mustLoad(f *testing.F, js string) Config {
	c, err := LoadConfig(nil, js)
	if err != nil {
		f.Fatal(err)
	}
	return c
}

// FuzzLoadConfig: any configuration text is a Config or an ErrConfig.
func FuzzLoadConfig(f *testing.F) {
	f.Add(`{"verify": "sample", "max_batch": 64, "inject": "lag"}`)
	f.Add(`{"listen": "0.0.0.0:0", "allow_insecure": true}`)
	f.Add(`{"retry_sleep_s": 1e308}`)
	f.Add(`[`)
	f.Fuzz(func(t *testing.T, js string) {
		c, err := LoadConfig(nil, js)
		if err != nil {
			if !errors.Is(err, errs.Config) {
				t.Fatalf("error outside ErrConfig: %v", err)
			}
			return
		}
		if c.MaxBatch < 1 || c.Timeout <= 0 || c.Verify.TailBytes < 1 {
			t.Fatalf("accepted an unusable config: %+v", c)
		}
	})
}
