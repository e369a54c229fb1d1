package samehost

import (
	"context"
	"crypto/rand"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// The kernel, not the offer, says which process a sender is: a proof from
// a process other than the one the offer named is refused, as is a target
// whose answer names another process than the one listening.
func TestIdentityIsTheKernels(t *testing.T) {
	var grants Grants
	id, err := NewIdentity(&grants, 5*time.Second)
	require.NoError(t, err)
	defer id.Close()
	nonce := make([]byte, NonceSize)
	rand.Read(nonce)
	ctx := context.Background()
	name := id.Name()

	grants.Put("mallory", Grant{Claimed: os.Getppid(), Nonce: nonce})
	require.Contains(t, Identify(ctx, name, nonce, os.Getpid()), "the kernel says")
	gr, _ := grants.Get("mallory")
	require.Zero(t, gr.Pid, "an offer that named another process proves nothing")

	require.Contains(t, Identify(ctx, name, nonce, os.Getppid()), "the kernel says its identity socket is process",
		"a sender lets no process read it that the kernel does not name as the receiver")

	other := make([]byte, NonceSize)
	require.Contains(t, Identify(ctx, name, other, os.Getpid()), "no same-host grant")

	grants.Put("sender", Grant{Claimed: os.Getpid(), Nonce: nonce})
	require.Empty(t, Identify(ctx, name, nonce, os.Getpid()))
	gr, _ = grants.Get("sender")
	require.Equal(t, os.Getpid(), gr.Pid)

	// A grant handed out again (a new handshake) needs a new proof.
	fresh := make([]byte, NonceSize)
	rand.Read(fresh)
	grants.Put("sender", Grant{Claimed: os.Getpid(), Nonce: fresh})
	gr, _ = grants.Get("sender")
	require.Zero(t, gr.Pid)
	require.Contains(t, Identify(ctx, name, nonce, os.Getpid()), "no same-host grant", "the old nonce is forgotten")
}
