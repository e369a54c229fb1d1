package engine

// transferCalls are engine calls still running, of one transfer or of
// the transfers to a session that began under one epoch: how many, and a
// channel closed when the last returns, made only once something waits
// for them (most calls end with nobody waiting: no channel to make).
// Kept by value in maps keyed by transfer or epoch, under Plane.mu.
type transferCalls struct {
	n    int
	done chan struct{}
}

// addCall counts one more call under key.
func addCall(m map[uint64]transferCalls, key uint64) {
	c := m[key]
	c.n++
	m[key] = c
}

// endCall counts one call under key as returned; the last one's end
// closes the channel a waiter took and drops the entry.
func endCall(m map[uint64]transferCalls, key uint64) {
	c, ok := m[key]
	if !ok {
		return
	}
	if c.n--; c.n > 0 {
		m[key] = c
		return
	}
	if c.done != nil {
		close(c.done)
	}
	delete(m, key)
}

// waitCalls returns the channel closed once the calls under key have all
// returned, or nil where none runs.
func waitCalls(m map[uint64]transferCalls, key uint64) <-chan struct{} {
	c, ok := m[key]
	if !ok {
		return nil
	}
	if c.done == nil {
		c.done = make(chan struct{})
		m[key] = c
	}
	return c.done
}
