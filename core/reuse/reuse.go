// Package reuse keeps buffers between calls without letting one huge call
// pin its room for good.
package reuse

import "unsafe"

// MaxKept bounds the bytes a reused buffer (a session's, a pooled sync's,
// a free notice's) keeps between calls.
const MaxKept = 64 << 10

// Keep returns b emptied for reuse, or nil where it grew past MaxKept.
func Keep[T any](b []T) []T {
	var elem T
	if uintptr(cap(b))*unsafe.Sizeof(elem) > MaxKept {
		return nil
	}
	return b[:0]
}
