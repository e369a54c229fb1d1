package core

import "unsafe"

// maxKeptBuf bounds the bytes a reused buffer (a session's, a pooled
// sync's, a free notice's) keeps between calls: one huge transfer does
// not pin its room for good.
const maxKeptBuf = 64 << 10

// keep returns b emptied for reuse, or nil where it grew past maxKeptBuf.
func keep[T any](b []T) []T {
	var elem T
	if uintptr(cap(b))*unsafe.Sizeof(elem) > maxKeptBuf {
		return nil
	}
	return b[:0]
}
