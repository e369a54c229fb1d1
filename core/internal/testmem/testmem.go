// Package testmem maps memory for tests as the library's callers have
// it: outside Go's heap (under -race, checkptr refuses Go heap memory
// handed around as addresses), unmapped when the test ends.
package testmem

import (
	"syscall"
	"testing"
)

// Map maps n bytes of anonymous memory for the test.
func Map(t testing.TB, n int) []byte {
	t.Helper()
	b, err := syscall.Mmap(-1, 0, n, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
	if err != nil {
		t.Fatalf("mmap %d bytes: %v", n, err)
	}
	t.Cleanup(func() { syscall.Munmap(b) })
	return b
}

// Pages maps n pages of 4 KiB, each byte holding its page's index.
func Pages(t testing.TB, n int) []byte {
	t.Helper()
	b := Map(t, n*4096)
	for i := range b {
		b[i] = byte(i / 4096)
	}
	return b
}
