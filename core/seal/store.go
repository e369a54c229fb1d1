package seal

import (
	"fmt"
	"sync"

	"github.com/mcguard/mcguard/core/errs"
)

// Published seals: a producer's seals kept under names (request ids) for
// readers to fetch from its guard, where the seal cannot travel in the
// application's own metadata. Bounded in count and bytes: past either the
// oldest are forgotten, and a reader that comes for one is told it is not
// there (as for a name never published).
const (
	// MaxPublished bounds the seals a guard keeps.
	MaxPublished = 4096
	// MaxPublishedBytes bounds their bytes in all.
	MaxPublishedBytes = 64 << 20
	// MaxFetched bounds one published seal: what a control reply carries.
	MaxFetched = 1 << 20
	// MaxName bounds a published seal's name.
	MaxName = 256
)

// Store holds published seals by name, oldest first out.
type Store struct {
	mu    sync.Mutex
	m     map[string][]byte
	order []string
	bytes int
}

// Put keeps s under name, in place of an older seal of that name.
func (st *Store) Put(name string, s []byte) error {
	if name == "" || len(name) > MaxName {
		return fmt.Errorf("%w: a published seal's name is 1 to %d bytes, not %d", errs.InvalidArg, MaxName, len(name))
	}
	if len(s) > MaxFetched {
		return fmt.Errorf("%w: a seal of %d bytes is over the %d a reader can fetch: carry it in the request's metadata instead", errs.InvalidArg, len(s), MaxFetched)
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.m == nil {
		st.m = map[string][]byte{}
	}
	st.drop(name)
	st.m[name], st.order, st.bytes = s, append(st.order, name), st.bytes+len(s)
	for len(st.m) > MaxPublished || st.bytes > MaxPublishedBytes {
		st.drop(st.order[0])
	}
	return nil
}

// Get is the seal published under name, or nil.
func (st *Store) Get(name string) []byte {
	st.mu.Lock()
	defer st.mu.Unlock()
	return st.m[name]
}

// Remove forgets the seal under name; it reports whether there was one.
func (st *Store) Remove(name string) bool {
	st.mu.Lock()
	defer st.mu.Unlock()
	_, ok := st.m[name]
	st.drop(name)
	return ok
}

// Len is how many seals are kept.
func (st *Store) Len() int {
	st.mu.Lock()
	defer st.mu.Unlock()
	return len(st.m)
}

// drop forgets name's seal, if any; the caller holds mu.
func (st *Store) drop(name string) {
	s, ok := st.m[name]
	if !ok {
		return
	}
	delete(st.m, name)
	st.bytes -= len(s)
	for i, n := range st.order {
		if n == name {
			st.order = append(st.order[:i], st.order[i+1:]...)
			break
		}
	}
}
