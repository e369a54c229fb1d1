// Package dl is the Go half that every run-time loader of a native library
// shares (the CUDA driver, libibverbs): each library's C loader dlopens it
// and fills a table of entry points, all or nothing, and this runs it with
// the calling OS thread locked, because dlerror is per thread.
package dl

/*
#include <stdlib.h>
*/
import "C"

import (
	"errors"
	"runtime"
	"unsafe"
)

// Loader is a library's C loader: it fills table from the library at path
// and returns 0, or writes a NUL-terminated reason into msg (msgLen bytes)
// and returns non-zero, leaving nothing loaded.
type Loader func(path, table, msg unsafe.Pointer, msgLen int) int

// Load runs load on path (def if empty) with a zeroed C table of
// tableSize bytes, and returns the table, to be freed with C free, or the
// loader's reason.
func Load(path, def string, tableSize uintptr, load Loader) (unsafe.Pointer, error) {
	if path == "" {
		path = def
	}
	table := C.calloc(1, C.size_t(tableSize))
	cpath := C.CString(path)
	defer C.free(unsafe.Pointer(cpath))
	var msg [512]C.char
	runtime.LockOSThread()
	rc := load(unsafe.Pointer(cpath), table, unsafe.Pointer(&msg[0]), len(msg))
	runtime.UnlockOSThread()
	if rc != 0 {
		C.free(table)
		return nil, errors.New(C.GoString(&msg[0]))
	}
	return table, nil
}
