package core

import (
	"fmt"
	"time"

	"github.com/mcguard/mcguard/core/control"
	"github.com/mcguard/mcguard/core/desc"
	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/core/seal"
	"github.com/mcguard/mcguard/verify"
)

// Verified reads: a producer seals ranges whose bytes are final (Seal),
// the application carries the seal to the reader with its own metadata,
// and the reader's read succeeds only when the bytes it landed are the
// sealed ones (ReadSealed over mcguard's data planes, CheckSeal after a
// read another engine made).

// SealModes are what a reader's check of a seal can be: Digest compares
// an xxh3-64 digest of every landed byte with the seal's; Tail compares
// only the last seal.TailSize bytes of each range (no digest: it proves
// that each range's end landed and is what the producer sealed, not its
// middle).
var SealModes = []verify.Mode{verify.Digest, verify.Tail}

// Seal publishes ranges of this guard's registered memory whose bytes are
// final: their digests and tails, this guard's identity, a serial, and a
// MAC under the shared secret when the guard has one. The bytes must not
// change until every reader has checked them; a reader of changed bytes
// fails.
func (g *Guard) Seal(ranges []desc.Range) ([]byte, error) {
	if err := g.enter(); err != nil {
		return nil, err
	}
	defer g.leave()
	if len(ranges) == 0 || len(ranges) > seal.MaxRanges {
		return nil, fmt.Errorf("%w: %d ranges (1 to %d per seal)", errs.InvalidArg, len(ranges), seal.MaxRanges)
	}
	addrs, lens := make([]uint64, len(ranges)), make([]uint64, len(ranges))
	for i, r := range ranges {
		if r.Len == 0 {
			return nil, fmt.Errorf("%w: range %d has length 0", errs.InvalidArg, i)
		}
		if err := g.regions.Check(r.Addr, r.Len); err != nil {
			return nil, fmt.Errorf("range %d: %w", i, err)
		}
		addrs[i], lens[i] = r.Addr, r.Len
	}
	s := seal.Seal{Producer: g.id, Serial: g.seals.Add(1), Entries: make([]seal.Entry, len(ranges))}
	k := 0
	err := g.regions.LoadRanges(addrs, lens, nil, func(b []byte) error {
		s.Entries[k] = seal.Entry{Addr: addrs[k], Len: lens[k], Digest: desc.DigestOf(b), Tail: seal.TailOf(b)}
		k++
		return nil
	})
	if err != nil {
		return nil, err
	}
	return seal.Encode(s, g.cfg.Secret), nil
}

// Publish seals ranges as Seal does and keeps the seal under name (a
// request id) for readers to fetch from this guard (FetchSeal), where it
// cannot travel in the application's own metadata. A later Publish under
// name replaces it; Withdraw forgets it; past seal.MaxPublished seals (or
// their bytes past seal.MaxPublishedBytes) the oldest are forgotten.
func (g *Guard) Publish(name string, ranges []desc.Range) error {
	s, err := g.Seal(ranges)
	if err != nil {
		return err
	}
	return g.published.Put(name, s)
}

// Withdraw forgets the seal published under name (the blocks are handed
// back): readers that come for it are told it is not there.
func (g *Guard) Withdraw(name string) error {
	if err := g.enter(); err != nil {
		return err
	}
	defer g.leave()
	if !g.published.Remove(name) {
		return fmt.Errorf("%w: no seal published under %q", errs.InvalidArg, name)
	}
	return nil
}

// FetchSeal asks the guard at session for the seal it published under
// name, asking again until it is there or timeout passes (errs.Timeout).
// The seal is checked when it is used (ReadSealed, CheckSeal), not here.
func (g *Guard) FetchSeal(session, name string, timeout time.Duration) ([]byte, error) {
	if err := g.enterSession(session); err != nil {
		return nil, err
	}
	defer g.leave()
	if name == "" || len(name) > seal.MaxName {
		return nil, fmt.Errorf("%w: a published seal's name is 1 to %d bytes", errs.InvalidArg, seal.MaxName)
	}
	ss := g.session(session)
	ss.mu.Lock()
	endpoint := ss.control
	ss.mu.Unlock()
	if endpoint == "" {
		return nil, fmt.Errorf("%w: session %s is reached through an engine, and this guard does not know where its peer's guard listens (mc_guard_set_peer_guard)", errs.Config, session)
	}
	deadline := time.Now().Add(timeout)
	pause := 200 * time.Microsecond
	for {
		// Each request has the connect timeout to be answered: the wait
		// for publication is the loop's, not the request's.
		s, pending, err := control.FetchSeal(g.ctx, g.zctx, endpoint, g.cfg.ConnectTimeout, g.handshakeTransport(), name)
		if err != nil || !pending {
			return s, err
		}
		left := time.Until(deadline)
		if left <= 0 {
			return nil, fmt.Errorf("%w: session %s published no seal under %q within %v", errs.Timeout, session, name, timeout)
		}
		select {
		case <-time.After(min(pause, left)):
		case <-g.ctx.Done():
			return nil, fmt.Errorf("%w", errs.Closed)
		}
		pause = min(2*pause, 20*time.Millisecond)
	}
}

// ID is this guard's identity: the producer its seals name.
func (g *Guard) ID() [seal.IDSize]byte { return g.id }

// CheckSeal compares the bytes a read landed in this guard's registered
// memory with sealed: reads[i] read sealed range i (Dst, its remote
// address, 0 where the caller does not know it) into [Src, +Len). mode
// is one of SealModes; producer, where not nil, is the producer the
// seal must name. It returns errs.Seal for a seal that does not decode,
// is not for these ranges or not from producer, and errs.Verify naming
// the ranges whose bytes differ.
func (g *Guard) CheckSeal(sealed []byte, reads []desc.Desc, mode verify.Mode, producer []byte) error {
	if err := g.enter(); err != nil {
		return err
	}
	defer g.leave()
	s, entries, err := g.openSeal(sealed, reads, mode)
	if err != nil {
		return err
	}
	return g.checkLanded(s, entries, reads, mode, producer)
}

// ReadSealed reads as Read does and then checks the landed bytes against
// sealed as CheckSeal does, the producer being the guard the session's
// handshake reached (unchecked over an engine whose peer guard is not
// known). A read that failed, or bytes that differ, never return nil.
func (g *Guard) ReadSealed(name string, descs []desc.Desc, sealed []byte, mode verify.Mode) error {
	if err := g.enter(); err != nil {
		return err
	}
	defer g.leave()
	s, entries, err := g.openSeal(sealed, descs, mode) // refused before any byte moves
	if err != nil {
		return err
	}
	producer, err := g.read(name, descs, true)
	if err != nil {
		return err
	}
	return g.checkLanded(s, entries, descs, mode, producer)
}

// openSeal decodes sealed under this guard's secret and pairs each range
// read with its sealed range (matchSeal).
func (g *Guard) openSeal(sealed []byte, reads []desc.Desc, mode verify.Mode) (seal.Seal, []seal.Entry, error) {
	s, err := seal.Decode(sealed, g.cfg.Secret)
	if err != nil {
		return s, nil, err
	}
	entries, err := matchSeal(s, reads, mode)
	return s, entries, err
}

// checkLanded compares the bytes reads landed with their sealed ranges,
// after checking that the seal is producer's (where producer is known).
func (g *Guard) checkLanded(s seal.Seal, entries []seal.Entry, reads []desc.Desc, mode verify.Mode, producer []byte) error {
	if producer != nil && string(producer) != string(s.Producer[:]) {
		return fmt.Errorf("%w: the seal names producer %x, and the bytes were read from %x", errs.Seal, s.Producer[:], producer)
	}
	addrs, lens := make([]uint64, len(reads)), make([]uint64, len(reads))
	for i, d := range reads {
		if err := g.regions.Check(d.Src, d.Len); err != nil {
			return fmt.Errorf("range %d local side: %w", i, err)
		}
		addrs[i], lens[i] = d.Src, d.Len
	}
	var bad []int
	k := 0
	err := g.regions.LoadRanges(addrs, lens, nil, func(b []byte) error {
		e := entries[k]
		if (mode == verify.Tail && seal.TailOf(b) != e.Tail) || (mode == verify.Digest && desc.DigestOf(b) != e.Digest) {
			bad = append(bad, k)
		}
		k++
		return nil
	})
	if err != nil {
		return err
	}
	if len(bad) > 0 {
		g.stats.sealMismatches.Add(int64(len(bad)))
		return &verify.MismatchError{Descs: bad, Where: fmt.Sprintf("read differ from seal %d of producer %x (%s check)", s.Serial, s.Producer[:], mode)}
	}
	g.stats.sealsChecked.Add(1)
	return nil
}

// matchSeal pairs each range read with its sealed range: the seal's
// ranges in order (a range whose remote address the reader does not name
// is taken at its place), or, where the reader names every remote
// address, the sealed range at that address for each (a read of some of
// a request's blocks, or of them over several reads). A range read that
// is not a sealed range, with its length, is refused.
func matchSeal(s seal.Seal, reads []desc.Desc, mode verify.Mode) ([]seal.Entry, error) {
	if mode != verify.Digest && mode != verify.Tail {
		return nil, fmt.Errorf("%w: a seal is checked in %s or %s mode, not %q", errs.InvalidArg, verify.Digest, verify.Tail, mode)
	}
	inOrder := len(reads) == len(s.Entries)
	named := true
	for i, d := range reads {
		named = named && d.Dst != 0
		if inOrder && (d.Len != s.Entries[i].Len || (d.Dst != 0 && d.Dst != s.Entries[i].Addr)) {
			inOrder = false
		}
	}
	switch {
	case inOrder:
		return s.Entries, nil
	case !named:
		return nil, fmt.Errorf("%w: the seal has %d ranges and the read %d, not all of them at a named address", errs.Seal, len(s.Entries), len(reads))
	}
	at := make(map[desc.Range]int, len(s.Entries))
	for i, e := range s.Entries {
		if _, ok := at[desc.Range{Addr: e.Addr, Len: e.Len}]; !ok {
			at[desc.Range{Addr: e.Addr, Len: e.Len}] = i
		}
	}
	entries := make([]seal.Entry, len(reads))
	for i, d := range reads {
		k, ok := at[desc.Range{Addr: d.Dst, Len: d.Len}]
		if !ok {
			return nil, fmt.Errorf("%w: range %d, [%#x, +%d), is not a range of the seal", errs.Seal, i, d.Dst, d.Len)
		}
		entries[i] = s.Entries[k]
	}
	return entries, nil
}
