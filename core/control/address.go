package control

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"syscall"
	"time"

	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/core/transport"
)

// Addresses: a guard listens on, and sessions name, "host:port" where host
// is an IPv4 address, a bracketed IPv6 address ("[::1]") or a host name
// ("localhost").

// ParseHostPort splits s and checks its port: 1 to 65535, or 0 where
// zeroOK (listen: pick a free one).
func ParseHostPort(s string, zeroOK bool) (host string, port int, err error) {
	host, p, err := net.SplitHostPort(s)
	if err != nil {
		return "", 0, err
	}
	if host == "" {
		return "", 0, fmt.Errorf("no host")
	}
	port, err = strconv.Atoi(p)
	if err != nil || port < 0 || port > 65535 || (port == 0 && !zeroOK) {
		return "", 0, fmt.Errorf("port %q is not a number from 1 to 65535", p)
	}
	return host, port, nil
}

func ValidSessionName(name string) error {
	if _, _, err := ParseHostPort(name, false); err != nil {
		return fmt.Errorf("%w: session %q is not \"host:port\" (%v); an IPv6 host goes in brackets: \"[::1]:5000\"", errs.InvalidArg, name, err)
	}
	return nil
}

// listenIP is the address a listen host binds: an IP as it is, a host
// name's first address.
func listenIP(host string) (net.IP, error) {
	if ip := net.ParseIP(host); ip != nil {
		return ip, nil
	}
	ips, err := net.DefaultResolver.LookupIP(context.Background(), "ip", host)
	if err != nil || len(ips) == 0 {
		return nil, fmt.Errorf("%w: cannot resolve listen host %q: %v", errs.Config, host, err)
	}
	return ips[0], nil
}

// reachControl finds the address of session's control endpoint that
// accepts connections: each address its host resolves to is tried with a
// TCP connect, which is closed at once. A peer that refuses everywhere is
// an error within milliseconds, not after the handshake's timeout.
func reachControl(ctx context.Context, session string, timeout time.Duration) (string, error) {
	host, port, err := ParseHostPort(session, false)
	if err != nil {
		return "", fmt.Errorf("%w: session %q: %v", errs.InvalidArg, session, err)
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	ips, err := net.DefaultResolver.LookupIP(ctx, "ip", host)
	if err != nil || len(ips) == 0 {
		return "", fmt.Errorf("%w: session %q: cannot resolve %q: %v", errs.Session, session, host, err)
	}
	var refused error
	for _, ip := range ips {
		addr := net.JoinHostPort(ip.String(), strconv.Itoa(port))
		c, err := transport.Connect(ctx, addr)
		if err == nil {
			c.Close()
			return addr, nil
		}
		switch {
		case errors.Is(err, syscall.ECONNREFUSED), errors.Is(err, syscall.EHOSTUNREACH), errors.Is(err, syscall.ENETUNREACH):
			refused = err // try the host's other addresses
		case ctx.Err() != nil:
			return "", fmt.Errorf("%w: session %q: no answer to a connection within %v (host down or partitioned?)", errs.Timeout, session, timeout)
		default:
			refused = err
		}
	}
	return "", fmt.Errorf("%w: session %q: %v (no guard listening there?)", errs.Peer, session, refused)
}
