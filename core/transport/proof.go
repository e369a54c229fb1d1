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

// ReplyKey is the key a data connection's replies are authenticated under
// where the guards share a secret (key is then the handshake's, which
// never crossed the wire): per connection, from its challenge.
func ReplyKey(key, challenge []byte) []byte {
	m := hmac.New(sha256.New, key)
	m.Write([]byte("mcguard/4 replies"))
	m.Write(challenge)
	return m.Sum(nil)
}
