package core

import (
	"fmt"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/mcguard/mcguard/core/control"
	"github.com/mcguard/mcguard/core/errs"
)

// maxEngineSession bounds the name of a session over an engine.
const maxEngineSession = 1024

// checkSession validates a session's name: over mcguard's own data planes
// the peer guard's "host:port"; over an engine, the engine's own name for
// the peer (Mooncake's "host:port" or segment name, a NIXL agent's
// name), which only needs to be printable text.
func (g *Guard) checkSession(name string) error {
	if g.engine == nil {
		return control.ValidSessionName(name)
	}
	if name == "" || len(name) > maxEngineSession || !utf8.ValidString(name) || strings.ContainsFunc(name, unicode.IsControl) {
		return fmt.Errorf("%w: session %q: an engine's peer name must be 1 to %d bytes of printable UTF-8", errs.InvalidArg, name, maxEngineSession)
	}
	return nil
}
