package transport

import (
	"errors"
	"net"
	"time"

	"github.com/mcguard/mcguard/core/logs"
)

// AcceptEach hands each connection accepted on ln to take until ln is
// closed or take says to stop. Any other Accept error (EMFILE, ENFILE,
// ECONNABORTED, ENOBUFS: a moment of exhaustion that any peer can cause)
// is waited out with backoff, logged as what's.
func AcceptEach(ln net.Listener, what string, take func(c net.Conn) (more bool)) {
	backoff := acceptBackoff(0)
	for {
		c, err := ln.Accept()
		if errors.Is(err, net.ErrClosed) {
			return
		}
		if err != nil {
			logs.Printf(logs.Info, "%s: accept: %v (retrying in %v)", what, err, backoff)
			time.Sleep(backoff)
			backoff = acceptBackoff(backoff)
			continue
		}
		backoff = acceptBackoff(0)
		if !take(c) {
			return
		}
	}
}

// acceptBackoff is the wait after an Accept error that followed a wait of
// last: 5 ms, doubling to at most a second.
func acceptBackoff(last time.Duration) time.Duration {
	if last == 0 {
		return 5 * time.Millisecond
	}
	return min(2*last, time.Second)
}
