package transport

import (
	"context"
	"errors"
	"net"
	"time"
)

// Connect opens a TCP connection to addr within ctx, starting a fresh
// connect whenever one has gone unanswered for a while. A listener whose
// accept queue is full (a flood of strangers) drops SYNs, and the kernel
// sends a dropped SYN again only after 1 s and then 3 s: a 2 s deadline
// would get two tries. Fresh connects, the first after 200 ms and then at
// most a second apart, get several. A refusal or unreachable host ends it
// at once with that error; ctx's end with the last attempt's.
func Connect(ctx context.Context, addr string) (net.Conn, error) {
	wait := firstConnectWait
	for {
		attempt, cancel := context.WithTimeout(ctx, wait)
		c, err := (&net.Dialer{}).DialContext(attempt, "tcp", addr)
		// The dialer's own timer, set from attempt's deadline, can fire
		// before attempt says it is done: either is an unanswered connect.
		var ne net.Error
		unanswered := attempt.Err() != nil || (errors.As(err, &ne) && ne.Timeout())
		cancel()
		if err == nil || ctx.Err() != nil || !unanswered {
			return c, err
		}
		wait = min(2*wait, maxConnectWait)
	}
}

const (
	firstConnectWait = 200 * time.Millisecond
	maxConnectWait   = time.Second
)
