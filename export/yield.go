package main

import "C"

import "runtime"

// mcgYield runs the Go scheduler once on the calling C thread, so that
// the scheduler slot the thread holds between calls counts as recently
// scheduled (shim.c's mcg_keep_slot says why that matters).
//
//export mcgYield
func mcgYield() {
	runtime.Gosched()
}
