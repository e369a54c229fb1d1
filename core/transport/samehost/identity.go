package samehost

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"net"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mcguard/mcguard/core/transport"
)

// Same-host identity: which process a same-host sender is, in the
// kernel's words rather than its own. Its handshake offer names a pid, but
// anything may be written there, and a target that copied "the sender's"
// memory out of whatever process was named would hand a peer the bytes of
// any process it may read, its own included. So the target listens on a
// Unix socket (abstract: nothing on disk, nothing left behind) and a
// sender connects to it and sends its grant's nonce: the kernel tells the
// target the connecting process (SO_PEERCRED), and only a pid proven so
// is ever read. It works both ways: the sender learns the listening
// process from the kernel too, and lets only that one read its memory.

// maxIdentityConns bounds the identity connections served at once; past
// it a new one is closed before anything is read or allocated.
const maxIdentityConns = 64

// Identity is a receiver's identity socket.
type Identity struct {
	ln      *net.UnixListener
	grants  *Grants
	timeout time.Duration
	busy    chan struct{}
	wg      sync.WaitGroup
}

// NewIdentity listens on a fresh abstract Unix socket, proving senders
// against g.
func NewIdentity(g *Grants, timeout time.Duration) (*Identity, error) {
	name := make([]byte, 12)
	rand.Read(name)
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: "@mcguard-" + hex.EncodeToString(name), Net: "unix"})
	if err != nil {
		return nil, err
	}
	id := &Identity{ln: ln, grants: g, timeout: timeout, busy: make(chan struct{}, maxIdentityConns)}
	id.wg.Add(1)
	go id.accept()
	return id, nil
}

// Name is the socket's address, for the handshake's answer.
func (id *Identity) Name() string { return id.ln.Addr().String() }

// Close stops the socket and waits for the proofs being served.
func (id *Identity) Close() {
	id.ln.Close()
	id.wg.Wait()
}

// accept serves identity connections until the listener closes.
func (id *Identity) accept() {
	defer id.wg.Done()
	transport.AcceptEach(id.ln, "same-host identity socket", func(c net.Conn) bool {
		select {
		case id.busy <- struct{}{}:
		default:
			c.Close() // a flood: honest senders try again on their next connection
			return true
		}
		id.wg.Add(1)
		go func() {
			defer id.wg.Done()
			defer func() { <-id.busy }()
			defer c.Close()
			id.serve(c.(*net.UnixConn))
		}()
		return true
	})
}

// serve reads one nonce and answers "" (proven) or why not.
func (id *Identity) serve(c *net.UnixConn) {
	c.SetDeadline(time.Now().Add(id.timeout))
	cred, err := peerCred(c)
	if err != nil {
		return
	}
	nonce := make([]byte, NonceSize)
	if _, err := io.ReadFull(c, nonce); err != nil {
		return
	}
	why := id.grants.prove(nonce, int(cred.Pid))
	c.Write(append([]byte{byte(len(why))}, why...))
}

// peerCred is what the kernel says of the process at the other end of c:
// for an accepted connection the one that connected, for a dialled one the
// one that listens.
func peerCred(c *net.UnixConn) (*unix.Ucred, error) {
	raw, err := c.SyscallConn()
	if err != nil {
		return nil, err
	}
	var cred *unix.Ucred
	var cerr error
	if err := raw.Control(func(fd uintptr) { cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED) }); err != nil {
		return nil, err
	}
	return cred, cerr
}

// Identify proves this process to the target listening on name with the
// grant's nonce, and checks that the target is process pid, as its answer
// said (it is the process this one then lets read its memory). It returns
// why not, or "".
func Identify(ctx context.Context, name string, nonce []byte, pid int) string {
	if name == "" {
		return "the receiver has no identity socket"
	}
	var d net.Dialer
	nc, err := d.DialContext(ctx, "unix", name)
	if err != nil {
		return fmt.Sprintf("the receiver's identity socket cannot be reached (another network namespace?): %v", err)
	}
	c := nc.(*net.UnixConn)
	defer c.Close()
	if dl, ok := ctx.Deadline(); ok {
		c.SetDeadline(dl)
	}
	cred, err := peerCred(c)
	if err != nil {
		return "SO_PEERCRED: " + err.Error()
	}
	if int(cred.Pid) != pid {
		return fmt.Sprintf("the receiver's answer names process %d but the kernel says its identity socket is process %d", pid, cred.Pid)
	}
	if _, err := c.Write(nonce); err != nil {
		return "proving this process: " + err.Error()
	}
	var n [1]byte
	if _, err := io.ReadFull(c, n[:]); err != nil {
		return "the receiver did not answer the identity proof: " + err.Error()
	}
	why := make([]byte, n[0])
	if _, err := io.ReadFull(c, why); err != nil {
		return "the receiver did not answer the identity proof: " + err.Error()
	}
	return string(why)
}
