package core

import (
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/mcguard/mcguard/core/auth"
	"github.com/mcguard/mcguard/core/config"
	"github.com/mcguard/mcguard/core/control"
	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/core/fault"
	"github.com/mcguard/mcguard/core/logs"
	"github.com/mcguard/mcguard/verify"
)

// Config is everything mc_guard_open accepts. Each setting has a JSON key
// and an MC_GUARD_* variable; JSON wins over env.
type Config struct {
	// Listen is the control endpoint "host:port" peers name as the session;
	// port 0 picks a free one. Loopback by default.
	Listen string
	// MaxBatch is how many descriptors are posted and verified at a time.
	MaxBatch int
	// Timeout bounds every wait on a peer's data connection.
	Timeout time.Duration
	// ConnectTimeout bounds the handshake with a new session.
	ConnectTimeout time.Duration
	// SyncTimeout bounds how long mc_guard_sync waits for notices and for
	// writes still in flight.
	SyncTimeout time.Duration
	// Secret authenticates peers both ways (HMAC challenge-response); nil
	// means none, and then Listen must be loopback unless AllowInsecure.
	Secret        []byte
	AllowInsecure bool
	// CUDA: "auto" loads libcuda if it is there (device memory then works;
	// without it all memory is host memory), "required" fails open without
	// it, "off" never loads it. CUDALibrary names another driver library.
	CUDA        string
	CUDALibrary string
	// Transport: "tcp", "rdma" or "auto". RequireRDMA turns auto's
	// fallback to TCP into an error (the silent fallback that hid
	// Mooncake users' corruption).
	Transport   string
	RequireRDMA bool
	// SameHost: "auto" (where the handshake shows one host and the
	// receiver can read this process, it copies the bytes straight out of
	// it), "off", or "required" (an error where it cannot be used).
	SameHost string
	// SameHostWriter, as a receiver: who copies a same-host sender's
	// host-memory writes: "sender" (it writes into this process itself
	// with process_vm_writev under a shared lease that unregister,
	// quiesce and abort honour: no socket round trip) or "receiver" (this
	// process reads them out of the sender).
	SameHostWriter string
	// DigestAt: where the receiver's sync gets its digests in digest
	// mode: "sync" (read from memory at sync time: what memory holds
	// then) or "landing" (taken by the TCP target as the bytes landed,
	// where it could; else read from memory). Sync is the default: it
	// proves more, and landing measured no faster on the machines we
	// have (measured on a 2-core VM).
	DigestAt string
	// Planes are each data plane's own settings (transports.go).
	Planes PlaneSettings
	// PostAhead: over TCP to another host, a read-back mode sends each
	// chunk's writes while the chunk before it is checked (verify.Pipeline).
	PostAhead bool
	// LogLevel, when set, is the process's log level (see core/logs).
	LogLevel string
	Verify   verify.Config // the verification policy, and when notices are sent
	Inject   fault.Config  // target-side fault injection, for tests and demos
	// Getenv is the environment the settings were read from (the live C
	// one under the C ABI), for settings read later: an engine's own.
	Getenv config.Getenv
}

// takeSecret sets the shared secret, given or read from secretFile, and
// refuses to listen beyond loopback on host without one unless
// allow_insecure says so (logged).
func (c *Config) takeSecret(secret, secretFile, host string) error {
	if secretFile != "" {
		if secret != "" {
			return fmt.Errorf("%w: give secret or secret_file, not both", errs.Config)
		}
		b, err := os.ReadFile(secretFile)
		if err != nil {
			return fmt.Errorf("%w: secret_file: %v", errs.Config, err)
		}
		secret = strings.TrimRight(string(b), "\r\n")
	}
	if secret != "" {
		if len(secret) < auth.SecretMinBytes {
			return fmt.Errorf("%w: the secret must be at least %d bytes (use e.g. `openssl rand -hex 32`)", errs.Config, auth.SecretMinBytes)
		}
		c.Secret = []byte(secret)
	}
	if c.Secret == nil && !auth.IsLoopback(host) {
		if !c.AllowInsecure {
			return fmt.Errorf("%w: listen %q reaches beyond this machine, and the guard has no secret: any peer could write into registered memory. Set secret (or secret_file, MC_GUARD_SECRET), or allow_insecure: true to accept that", errs.Config, c.Listen)
		}
		logs.Printf(logs.Warn, "listening on %s without a secret (allow_insecure): any peer that reaches it can read and write registered memory", c.Listen)
	}
	return nil
}

// DefaultConfig returns the settings used when nothing is configured.
func DefaultConfig() Config {
	return Config{
		Listen:         "127.0.0.1:0",
		MaxBatch:       512,
		Timeout:        5 * time.Second,
		ConnectTimeout: 2 * time.Second,
		CUDA:           "auto",
		Transport:      "auto",
		SameHost:       "auto",
		SameHostWriter: "sender",
		DigestAt:       "sync",
		Planes:         defaultPlaneSettings(),
		PostAhead:      true,
		SyncTimeout:    5 * time.Second,
		Verify:         verify.Defaults(),
		Inject:         fault.Config{Mode: fault.None, Rate: 0.1, LagMax: 20 * time.Millisecond},
	}
}

// LoadConfig builds a Config from the environment and the open() JSON.
func LoadConfig(getenv config.Getenv, configJSON string) (Config, error) {
	l, err := config.NewLoader(getenv, configJSON)
	if err != nil {
		return Config{}, err
	}
	c := DefaultConfig()
	c.Getenv = getenv
	l.String("listen", []string{"MC_GUARD_LISTEN"}, &c.Listen)
	l.Int("max_batch", []string{"MC_GUARD_MAX_BATCH"}, &c.MaxBatch, 1, 1<<16)
	l.Millis("timeout_ms", []string{"MC_GUARD_TIMEOUT_MS"}, &c.Timeout, time.Hour)
	l.Millis("connect_timeout_ms", []string{"MC_GUARD_CONNECT_TIMEOUT_MS"}, &c.ConnectTimeout, time.Hour)
	l.Millis("sync_timeout_ms", []string{"MC_GUARD_SYNC_TIMEOUT_MS"}, &c.SyncTimeout, time.Hour)
	var secret, secretFile string
	l.String("secret", []string{"MC_GUARD_SECRET"}, &secret)
	l.String("secret_file", []string{"MC_GUARD_SECRET_FILE"}, &secretFile)
	l.Bool("allow_insecure", []string{"MC_GUARD_ALLOW_INSECURE"}, &c.AllowInsecure)
	l.Choice("cuda", []string{"MC_GUARD_CUDA"}, &c.CUDA, []string{"auto", "required", "off"}, nil)
	l.String("cuda_library", []string{"MC_GUARD_CUDA_LIBRARY"}, &c.CUDALibrary)
	l.Choice("transport", []string{"MC_GUARD_TRANSPORT"}, &c.Transport, []string{"tcp", "rdma", "auto"}, nil)
	l.Bool("require_rdma", []string{"MC_GUARD_REQUIRE_RDMA"}, &c.RequireRDMA)
	l.Choice("same_host", []string{"MC_GUARD_SAME_HOST"}, &c.SameHost, []string{"auto", "off", "required"}, nil)
	l.Choice("same_host_writer", []string{"MC_GUARD_SAME_HOST_WRITER"}, &c.SameHostWriter, []string{"sender", "receiver"}, nil)
	l.Choice("digest_at", []string{"MC_GUARD_DIGEST_AT"}, &c.DigestAt, []string{"landing", "sync"}, nil)
	c.Planes.load(l)
	l.Bool("post_ahead", []string{"MC_GUARD_POST_AHEAD"}, &c.PostAhead)
	l.Choice("log_level", []string{"MC_GUARD_LOG_LEVEL"}, &c.LogLevel, logs.Levels, nil)
	c.Verify = verify.Load(l)
	l.Choice("inject", []string{"MC_GUARD_INJECT"}, &c.Inject.Mode, fault.Modes, map[string]string{"": "none", "off": "none"})
	l.Float("inject_rate", []string{"MC_GUARD_INJECT_RATE"}, &c.Inject.Rate, 0, 1)
	l.Millis("inject_lag_max_ms", []string{"MC_GUARD_INJECT_LAG_MAX_MS"}, &c.Inject.LagMax, time.Minute)
	l.Int("inject_seed", []string{"MC_GUARD_INJECT_SEED"}, &c.Inject.Seed, 0, 1<<31-1)
	if err := l.Err(); err != nil {
		return Config{}, err
	}
	if c.LogLevel != "" {
		lvl, _ := logs.ParseLevel(c.LogLevel) // a Choice of logs.Levels
		logs.SetLevel(lvl)
	}
	host, _, err := control.ParseHostPort(c.Listen, true)
	if err != nil {
		return Config{}, fmt.Errorf("%w: listen %q is not host:port (%v); an IPv6 host goes in brackets: \"[::1]:0\"", errs.Config, c.Listen, err)
	}
	if err := c.takeSecret(secret, secretFile, host); err != nil {
		return Config{}, err
	}
	if c.RequireRDMA {
		if c.Transport == "tcp" {
			return Config{}, fmt.Errorf("%w: transport \"tcp\" and require_rdma true contradict each other: choose transport rdma (or auto with require_rdma), or drop require_rdma", errs.Config)
		}
		c.Transport = "rdma" // auto that must not fall back is rdma
	}
	if c.Timeout <= 0 || c.ConnectTimeout <= 0 || c.SyncTimeout <= 0 {
		return Config{}, fmt.Errorf("%w: timeout_ms, connect_timeout_ms and sync_timeout_ms must be positive", errs.Config)
	}
	return c, nil
}
