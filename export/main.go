// Command export is libmcguard's C ABI: the //export functions and nothing
// else. Each decodes its C arguments, looks up the handle, calls core, and
// maps the error to a status code and a per-thread message. The public
// names (mc_guard_*) are C functions in shim.c that call these.
package main

/*
#cgo CFLAGS: -I${SRCDIR}/../include
#include "mcguard.h"
#include "mcguard_internal.h"
#include <stdlib.h>
*/
import "C"

import (
	"fmt"
	"unsafe"

	"github.com/mcguard/mcguard/core"
	"github.com/mcguard/mcguard/core/errs"
)

func main() {}

// cGetenv reads the live C environment, which a host program (Python's
// os.environ) may have changed after the library loaded.
func cGetenv(name string) (string, bool) {
	cs := C.CString(name)
	defer C.free(unsafe.Pointer(cs))
	v := C.mcg_getenv(cs)
	if v == nil {
		return "", false
	}
	return C.GoString(v), true
}

//export mcgOpen
func mcgOpen(configJSON *C.char, out *C.mc_guard_t) (st C.mc_status) {
	defer recoverInto(&st, 0, "mc_guard_open")
	if out == nil {
		return fail(0, fmt.Errorf("%w: out is NULL", errs.InvalidArg))
	}
	return openGuard(configJSON, out, core.Open)
}

// openGuard loads the settings of configJSON (NULL: none) and the live
// environment, opens a guard with them, and hands out its handle.
func openGuard(configJSON *C.char, out *C.mc_guard_t, open func(core.Config) (*core.Guard, error)) C.mc_status {
	js := ""
	if configJSON != nil {
		js = C.GoString(configJSON)
	}
	cfg, err := core.LoadConfig(cGetenv, js)
	if err != nil {
		return fail(0, err)
	}
	g, err := open(cfg)
	if err != nil {
		return fail(0, err)
	}
	*out = C.mc_guard_t(handles.add(g))
	return C.MC_OK
}

//export mcgClose
func mcgClose(h C.mc_guard_t) (st C.mc_status) {
	defer recoverInto(&st, h, "mc_guard_close")
	g, err := handles.remove(uint64(h))
	if err != nil {
		return fail(h, err)
	}
	if err := g.Close(); err != nil {
		return fail(h, err)
	}
	return C.MC_OK
}

//export mcgRegister
func mcgRegister(h C.mc_guard_t, addr unsafe.Pointer, n C.size_t) C.mc_status {
	return run(h, "mc_guard_register", func(g *core.Guard) error {
		return g.Register(uint64(uintptr(addr)), uint64(n))
	})
}

//export mcgRegisterDevice
func mcgRegisterDevice(h C.mc_guard_t, addr unsafe.Pointer, n C.size_t) C.mc_status {
	return run(h, "mc_guard_register_device", func(g *core.Guard) error {
		return g.RegisterDevice(uint64(uintptr(addr)), uint64(n))
	})
}

//export mcgAlloc
func mcgAlloc(h C.mc_guard_t, n C.size_t, out *unsafe.Pointer) C.mc_status {
	return run(h, "mc_guard_alloc", func(g *core.Guard) error {
		if out == nil {
			return fmt.Errorf("%w: out is NULL", errs.InvalidArg)
		}
		*out = nil
		addr, err := g.Alloc(uint64(n))
		if err == nil {
			*out = unsafe.Pointer(uintptr(addr))
		}
		return err
	})
}

//export mcgFree
func mcgFree(h C.mc_guard_t, addr unsafe.Pointer) C.mc_status {
	return run(h, "mc_guard_free", func(g *core.Guard) error {
		return g.Free(uint64(uintptr(addr)))
	})
}

//export mcgUnregister
func mcgUnregister(h C.mc_guard_t, addr unsafe.Pointer) C.mc_status {
	return run(h, "mc_guard_unregister", func(g *core.Guard) error {
		return g.Unregister(uint64(uintptr(addr)))
	})
}
