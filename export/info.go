// Exports that copy text out: the endpoint, stats, metrics.

package main

/*
#cgo CFLAGS: -I${SRCDIR}/../include
#include "mcguard.h"
#include "mcguard_internal.h"
#include <stdlib.h>
*/
import "C"

import (
	"errors"
	"fmt"
	"unsafe"

	"github.com/mcguard/mcguard/core"
	"github.com/mcguard/mcguard/core/errs"
)

//export mcgEndpoint
func mcgEndpoint(h C.mc_guard_t, buf *C.char, n C.size_t) C.mc_status {
	return run(h, "mc_guard_endpoint", func(g *core.Guard) error {
		return copyOut(g.Endpoint(), buf, n, nil)
	})
}

//export mcgStats
func mcgStats(h C.mc_guard_t, buf *C.char, n C.size_t, needed *C.size_t) C.mc_status {
	return run(h, "mc_guard_stats", func(g *core.Guard) error {
		js, err := g.Stats()
		if err != nil {
			return err
		}
		return copyOut(string(js), buf, n, needed)
	})
}

//export mcgMetrics
func mcgMetrics(h C.mc_guard_t, buf *C.char, n C.size_t, needed *C.size_t) C.mc_status {
	return run(h, "mc_guard_metrics", func(g *core.Guard) error {
		text, err := g.Metrics()
		if err != nil {
			return err
		}
		return copyOut(string(text), buf, n, needed)
	})
}

// copyOut writes s and a NUL into the caller's buffer of n bytes.
func copyOut(s string, buf *C.char, n C.size_t, needed *C.size_t) error {
	if needed != nil {
		*needed = C.size_t(len(s))
	}
	if buf == nil {
		return fmt.Errorf("%w: buf is NULL", errs.InvalidArg)
	}
	if uint64(n) < uint64(len(s))+1 {
		return fmt.Errorf("%w: %d bytes needed, buffer has %d", errBufferTooSmall, len(s)+1, uint64(n))
	}
	out := unsafe.Slice((*byte)(unsafe.Pointer(buf)), len(s)+1)
	copy(out, s)
	out[len(s)] = 0
	return nil
}

var errBufferTooSmall = errors.New("buffer too small")
