package samehost

import (
	"fmt"
	"sync"
)

// Grant is what a receiver keeps of a sender that may use same-host
// transfers: the pid its offer named, the nonce it proves itself with,
// and its pid as the kernel said it on the identity socket (0 until then:
// nothing may be read from it).
type Grant struct {
	Claimed int
	Pid     int
	Nonce   []byte
	NoIPC   bool // opening one of its CUDA IPC handles failed here: it stages
}

// NonceSize is a grant's nonce.
const NonceSize = 16

// maxGrants bounds the grants a target keeps (one per sender's latest
// handshake); past it the oldest is forgotten and that sender's next
// connection sends its bytes through the socket.
const maxGrants = 4096

// Grants are a receiver's grants, by sender.
type Grants struct {
	mu      sync.Mutex
	m       map[string]Grant
	byNonce map[string]string // a grant's nonce: its sender
	order   []string
}

// Put hands sender a new grant (its handshake's), in place of any older.
func (g *Grants) Put(sender string, gr Grant) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.m == nil {
		g.m, g.byNonce = map[string]Grant{}, map[string]string{}
	}
	if old, ok := g.m[sender]; !ok {
		g.order = append(g.order, sender)
	} else {
		gr.NoIPC = gr.NoIPC || old.NoIPC
		delete(g.byNonce, string(old.Nonce))
	}
	g.m[sender] = gr
	g.byNonce[string(gr.Nonce)] = sender
	for len(g.order) > maxGrants {
		delete(g.byNonce, string(g.m[g.order[0]].Nonce))
		delete(g.m, g.order[0])
		g.order = g.order[1:]
	}
}

// prove records that the kernel says the holder of nonce is process pid,
// where that is the process its offer named; it returns why not, or "".
func (g *Grants) prove(nonce []byte, pid int) string {
	g.mu.Lock()
	defer g.mu.Unlock()
	sender, ok := g.byNonce[string(nonce)]
	if !ok {
		return "no same-host grant holds this nonce (forgotten, or crowded out)"
	}
	gr := g.m[sender]
	if gr.Claimed != pid {
		return fmt.Sprintf("the offer named process %d, the kernel says %d", gr.Claimed, pid)
	}
	gr.Pid = pid
	g.m[sender] = gr
	return ""
}

// RefuseIPC makes the sender's next handshakes offer no CUDA IPC.
func (g *Grants) RefuseIPC(sender string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if gr, ok := g.m[sender]; ok {
		gr.NoIPC = true
		g.m[sender] = gr
	}
}

// Get is sender's grant, if it has one.
func (g *Grants) Get(sender string) (Grant, bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	gr, ok := g.m[sender]
	return gr, ok
}
