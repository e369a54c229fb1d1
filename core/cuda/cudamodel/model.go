// Package cudamodel builds and drives the software model of the CUDA
// driver (tests/cudamodel/cudamodel.c) for tests: it is a non-test package
// because _test.go files cannot use cgo.
package cudamodel

/*
#cgo LDFLAGS: -ldl
#include <dlfcn.h>
#include <stdlib.h>
#include <stdint.h>

typedef int (*alloc_fn)(unsigned long long *, size_t);
typedef int (*free_fn)(unsigned long long);
typedef int (*deferred_fn)(unsigned long long, const void *, size_t);
typedef void (*fail_fn)(int);
typedef int (*retain_fn)(void **, int);
typedef int (*setcur_fn)(void *);
typedef int (*screate_fn)(void **, unsigned int);

static int make_stream(void *retain, void *setcur, void *screate, unsigned long long *out) {
    void *ctx = 0, *s = 0;
    int r = ((retain_fn)retain)(&ctx, 0);
    if (r == 0) r = ((setcur_fn)setcur)(ctx);
    if (r == 0) r = ((screate_fn)screate)(&s, 1);
    *out = (unsigned long long)(uintptr_t)s;
    return r;
}

static void *model_open(const char *path) { return dlopen(path, RTLD_NOW | RTLD_LOCAL); }
static void *model_sym(void *h, const char *name) { return dlsym(h, name); }
static int call_alloc(void *f, unsigned long long *p, size_t n) { return ((alloc_fn)f)(p, n); }
static int call_free(void *f, unsigned long long p) { return ((free_fn)f)(p); }
static int call_deferred(void *f, unsigned long long d, const void *s, size_t n) { return ((deferred_fn)f)(d, s, n); }
static void call_fail(void *f, int n) { ((fail_fn)f)(n); }
*/
import "C"

import (
	"fmt"
	"runtime"
	"unsafe"

	"github.com/mcguard/mcguard/core/internal/models"
)

// Path is the model library that `make build` built (MCGUARD_CUDA_MODEL).
func Path() (string, error) { return models.CUDA() }

// Model is a handle on a loaded model library.
type Model struct {
	alloc, free, deferred, fail unsafe.Pointer
	retain, setCurrent, stream  unsafe.Pointer
}

// Open loads the model at path (the same library the driver loader opens).
func Open(path string) (*Model, error) {
	cpath := C.CString(path)
	defer C.free(unsafe.Pointer(cpath))
	runtime.LockOSThread()
	h := C.model_open(cpath)
	runtime.UnlockOSThread()
	if h == nil {
		return nil, fmt.Errorf("cannot load the CUDA model %s", path)
	}
	sym := func(name string) unsafe.Pointer {
		cs := C.CString(name)
		defer C.free(unsafe.Pointer(cs))
		return C.model_sym(h, cs)
	}
	m := &Model{alloc: sym("cuMemAlloc_v2"), free: sym("cuMemFree_v2"), deferred: sym("mcgModelDeferredWrite"), fail: sym("mcgModelFailCopies"),
		retain: sym("cuDevicePrimaryCtxRetain"), setCurrent: sym("cuCtxSetCurrent"), stream: sym("cuStreamCreate")}
	if m.alloc == nil || m.free == nil || m.deferred == nil || m.fail == nil || m.retain == nil || m.setCurrent == nil || m.stream == nil {
		return nil, fmt.Errorf("%s is not the mcguard CUDA model", path)
	}
	return m, nil
}

// Alloc returns n bytes of model "device" memory (call after cuInit).
func (m *Model) Alloc(n int) (uint64, error) {
	var p C.ulonglong
	if r := C.call_alloc(m.alloc, &p, C.size_t(n)); r != 0 {
		return 0, fmt.Errorf("cuMemAlloc: CUresult %d", int(r))
	}
	return uint64(p), nil
}

// Free frees what Alloc returned.
func (m *Model) Free(p uint64) error {
	if r := C.call_free(m.free, C.ulonglong(p)); r != 0 {
		return fmt.Errorf("cuMemFree: CUresult %d", int(r))
	}
	return nil
}

// DeferredWrite writes into device memory as a NIC would: the bytes become
// visible only at cuFlushGPUDirectRDMAWrites or a context synchronisation.
func (m *Model) DeferredWrite(dst uint64, src []byte) error {
	if r := C.call_deferred(m.deferred, C.ulonglong(dst), unsafe.Pointer(&src[0]), C.size_t(len(src))); r != 0 {
		return fmt.Errorf("deferred write: CUresult %d", int(r))
	}
	return nil
}

// Stream creates a stream, as an application's CUDA code would, and
// returns its handle (a CUstream as an integer).
func (m *Model) Stream() (uint64, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	var s C.ulonglong
	if r := C.make_stream(m.retain, m.setCurrent, m.stream, &s); r != 0 {
		return 0, fmt.Errorf("cuStreamCreate: CUresult %d", int(r))
	}
	return uint64(s), nil
}

// FailCopies makes the next n copy calls fail.
func (m *Model) FailCopies(n int) { C.call_fail(m.fail, C.int(n)) }

// Bytes views model device memory (it is host memory underneath): what a
// kernel would read.
func Bytes(addr uint64, n int) []byte {
	return unsafe.Slice((*byte)(unsafe.Pointer(uintptr(addr))), n)
}
