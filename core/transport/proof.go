package transport

import (
	"crypto/hmac"
	"crypto/sha256"
)

// ConnectionProof is what a sender's data-connection hello carries besides
// the handshake's token: HMAC-SHA256 under the handshake's key of the
// challenge the target sent on that connection. The key never crosses the
// wire when the guards share a secret, and the challenge is fresh per
// connection, so a hello seen on the wire proves nothing on another
// connection.
func ConnectionProof(key, challenge []byte) []byte {
	m := hmac.New(sha256.New, key)
	m.Write([]byte("mcguard/4 connection"))
	m.Write(challenge)
	return m.Sum(nil)
}
