package samehost

import (
	"crypto/rand"
	"fmt"

	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/core/logs"
)

// The per-peer choice of the same-host path, in one place for any data
// plane that carries its handshake: what a sender offers, what a receiver
// answers, and what the sender does when the path cannot be used.

// Settings: whether a data plane uses the same-host path, and which side
// of it copies.
const (
	Auto     = "auto"     // use it where the handshake shows one host and the target can read the sender
	Off      = "off"      // always send the bytes through the data plane
	Required = "required" // fail where it cannot be used, saying why

	WriterSender   = "sender"   // same-host senders write host memory into the target themselves
	WriterReceiver = "receiver" // the target copies it out of them
)

// OfferFor is a sender's handshake offer under setting: where it runs, or
// nothing when the path is off.
func OfferFor(setting string) []byte {
	if setting == Off {
		return nil
	}
	return Offer()
}

// Answer decides, for a sender's offer, whether it may use the same-host
// path with this receiver: a nonce for it to prove (granted here), or why
// not. The offer is the sender's word; nothing is read from its pid until
// the identity socket proved it.
func (g *Grants) Answer(setting string, hasIdentity bool, sender string, offer []byte) (nonce []byte, why string) {
	if setting == Off {
		return nil, "the receiver turned same-host transfers off"
	}
	if !hasIdentity {
		return nil, "the receiver has no identity socket"
	}
	pid, why := Compare(offer)
	if why != "" {
		return nil, why
	}
	n := make([]byte, NonceSize)
	rand.Read(n)
	g.Put(sender, Grant{Claimed: pid, Nonce: n})
	return n, ""
}

// fallback says once per process why an automatic same-host path fell
// back to the data plane.
var fallback logs.Once

// Decline is the sender's choice when the path cannot be used with a
// peer, why saying why: under Required the connection fails; under Auto
// the bytes go through the data plane, logged once and counted in fb
// (nil: not counted), unless the peer is simply elsewhere.
func Decline(setting, why string, fb *Fallbacks) error {
	switch {
	case setting == Required:
		return fmt.Errorf("%w: same_host is required and cannot be used with this receiver: %s", errs.Config, why)
	case setting == Auto && why != NotThisHost && why != NotThisPidNS:
		fallback.Printf(logs.Info, "same-host transfers not used (bytes go through the socket): %s", why)
		if fb != nil {
			fb.Count(why)
		}
	}
	return nil
}
