package main

/*
#include "mcguard.h"
#include "mcguard_internal.h"
#include <stdlib.h>
*/
import "C"

import (
	"fmt"
	"unsafe"

	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/core/logs"
)

//export mcgSetLog
func mcgSetLog(level C.int32_t, fn C.mc_log_fn, ctx unsafe.Pointer) (st C.mc_status) {
	defer recoverInto(&st, 0, "mc_guard_set_log")
	if level != -1 && (level < 0 || int(level) >= len(logs.Levels)) {
		return fail(0, fmt.Errorf("%w: log level %d is not an MC_LOG_* value", errs.InvalidArg, level))
	}
	if level != -1 {
		logs.SetLevel(logs.Level(level))
	}
	if fn == nil {
		logs.SetSink(nil)
		return C.MC_OK
	}
	// ctx is the caller's pointer, handed back as it is; never dereferenced.
	c := uintptr(ctx)
	logs.SetSink(func(l logs.Level, msg string) {
		cmsg := C.CString(msg)
		defer C.free(unsafe.Pointer(cmsg))
		C.mcg_call_log(fn, C.int32_t(l), cmsg, unsafe.Pointer(c))
	})
	return C.MC_OK
}
