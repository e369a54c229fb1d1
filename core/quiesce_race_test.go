package core

import (
	"bytes"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/core/errs"
)

// A transfer that began before a quiesce lands nothing in the quiesced
// ranges once the quiesce returned: its later chunks are refused and it
// fails with MC_ERR_QUIESCED, over the socket and on one host, whoever
// copies. (Its second chunk, sent after the sender read the quiesce's
// mark, was taken as a write sent after the quiesce: the transfer
// returned MC_OK and overwrote the reused block.)
func TestATransferThatBeganBeforeAQuiesceNeverLandsAfterIt(t *testing.T) {
	for _, c := range []struct{ name, send, recv string }{
		{"socket", `"same_host": "off"`, `"same_host": "off"`},
		{"same host, sender writes", `"same_host": "required"`, `"same_host_writer": "sender"`},
		{"same host, receiver copies", `"same_host": "required"`, `"same_host_writer": "receiver"`},
	} {
		t.Run(c.name, func(t *testing.T) {
			const size = 4096
			p := newPair(t, `{"verify": "tail", "max_batch": 1, "post_ahead": false, `+c.send+`}`, `{`+c.recv+`}`, 2*size)
			fill(p.src.b)
			_, err := p.send.Transfer(p.session, p.blocks(2, size), TransferOptions{})
			require.NoError(t, err, "a first transfer: connected, and same-host where asked")

			reused := bytes.Repeat([]byte{0x5A}, size)
			p.send.afterChunk = func(base int) {
				if base == 0 { // between the chunks: the receiver aborts the request and reuses block 1
					require.NoError(t, p.recv.Quiesce([]SyncRange{{p.dst.addr(size), size}}))
					copy(p.dst.b[size:], reused)
				}
			}
			fill(p.src.b)
			_, err = p.send.Transfer(p.session, p.blocks(2, size), TransferOptions{})
			require.ErrorIs(t, err, errs.Quiesced)
			require.Equal(t, reused, p.dst.b[size:], "nothing of the transfer landed after the quiesce returned")
			require.Equal(t, p.src.b[:size], p.dst.b[:size], "its first chunk landed before")

			p.send.afterChunk = nil
			fill(p.src.b)
			_, err = p.send.Transfer(p.session, p.blocks(2, size), TransferOptions{})
			require.NoError(t, err, "the next transfer began after the quiesce: taken")
			require.Equal(t, p.src.b, p.dst.b)
		})
	}
}
