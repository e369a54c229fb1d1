package core

import (
	"fmt"

	"github.com/mcguard/mcguard/core/desc"
	"github.com/mcguard/mcguard/core/transport"
)

// readWindow bounds the bytes one Read fetches into the session's scratch
// before storing them: the scratch stays small for any batch.
const readWindow = 64 << 20

// Read copies remote bytes into local registered memory: for each
// descriptor, Len bytes from the session's Dst into local Src.
func (g *Guard) Read(name string, descs []desc.Desc) error {
	if err := g.enter(); err != nil {
		return err
	}
	defer g.leave()
	_, err := g.read(name, descs, false)
	return err
}

// read is Read. Where identify is set it returns the identity of the
// guard the session's handshake reached (over an engine, the peer's guard
// where the application named it; nil where there is none).
func (g *Guard) read(name string, descs []desc.Desc, identify bool) (producer []byte, err error) {
	if _, err := g.checkBatch(name, descs); err != nil {
		return nil, err
	}
	s, err := g.lockSession(g.ctx, name, descs)
	if err != nil {
		return nil, err
	}
	defer s.mu.Unlock()
	if identify && g.engine != nil && s.control != "" {
		if err := s.greet(g.ctx, g); err != nil {
			return nil, err
		}
	}
	// Under the producer's quiesces as a transfer's writes are: a read sent
	// before the producer quiesced its ranges is refused there.
	if err := s.beginTransfer(g.ctx); err != nil {
		s.disconnect()
		return nil, fmt.Errorf("session %s: %w", name, err)
	}
	defer s.endTransfer()
	var slices []transport.Slice
	for sl := range transport.Slices(descs) {
		slices = append(slices, sl)
	}
	size := func(i int) uint64 { return slices[i].Len }
	var ranges []desc.Range
	for start, end := range transport.Groups(len(slices), size, len(slices), readWindow) {
		ranges = ranges[:0]
		var total uint64
		for _, sl := range slices[start:end] {
			ranges = append(ranges, desc.Range{Addr: sl.Dst, Len: sl.Len})
			total += sl.Len
		}
		buf := s.scratch.Bytes(total)
		if err := s.conn.Read(g.ctx, ranges, buf, false); err != nil {
			s.disconnect()
			return nil, fmt.Errorf("session %s: %w", name, err)
		}
		for _, sl := range slices[start:end] {
			if err := g.regions.Store(sl.Src, sl.Len, func(m []byte) error { copy(m, buf[:sl.Len]); return nil }); err != nil {
				return nil, err
			}
			buf = buf[sl.Len:]
		}
	}
	return s.hello.Guard, nil
}
