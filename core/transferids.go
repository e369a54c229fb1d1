package core

import (
	"crypto/cipher"
	"crypto/des"
	"crypto/rand"
	"encoding/binary"
	"sync"
	"sync/atomic"
)

// transferIDs hands out a guard's transfer ids: a counter put through a
// keyed 64-bit permutation (Triple DES under a key of this guard's own).
// Ids never repeat within a guard, as a counter's would not, but a peer
// that saw some cannot tell the next: a receiver keeps notices by id, and
// a predictable id let any peer with a token send its notice under
// another sender's coming transfer first.
type transferIDs struct {
	mu      sync.Mutex
	block   cipher.Block
	in, out [8]byte // the cipher's buffers: kept here, an interface call's arguments would escape
	next    atomic.Uint64
}

func newTransferIDs() *transferIDs {
	key := make([]byte, 24)
	rand.Read(key)
	block, err := des.NewTripleDESCipher(key)
	if err != nil {
		panic(err) // only a key of the wrong length fails
	}
	return &transferIDs{block: block}
}

// give returns a new id, never 0 (0 names no transfer).
func (t *transferIDs) give() uint64 {
	for {
		if id := t.permute(t.next.Add(1)); id != 0 {
			return id
		}
	}
}

func (t *transferIDs) permute(n uint64) uint64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	binary.LittleEndian.PutUint64(t.in[:], n)
	t.block.Encrypt(t.out[:], t.in[:])
	return binary.LittleEndian.Uint64(t.out[:])
}

// gave reports whether this guard gave id.
func (t *transferIDs) gave(id uint64) bool {
	if id == 0 {
		return false
	}
	t.mu.Lock()
	binary.LittleEndian.PutUint64(t.in[:], id)
	t.block.Decrypt(t.out[:], t.in[:])
	n := binary.LittleEndian.Uint64(t.out[:])
	t.mu.Unlock()
	return n >= 1 && n <= t.next.Load()
}
