// Package verbs is mcguard's view of rdma-core's libibverbs, loaded at run
// time, once per process: the symbol table, the device probe that
// transport selection uses, and the queue-pair layer (endpoint.go: memory
// regions, host and dmabuf; RC queue pairs through INIT, RTR and RTS;
// chained WRITEs, READs and FLUSHes built in C memory; completions). The
// RDMA data plane (core/transport/rdma) is built on it.
package verbs

/*
#cgo LDFLAGS: -ldl
#include <stdlib.h>
#include "verbs_shim.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"sync"
	"syscall"
	"unsafe"

	"github.com/mcguard/mcguard/core/internal/dl"
)

// DefaultLibrary is what Load opens when no path is given.
const DefaultLibrary = "libibverbs.so.1"

var (
	// ErrUnavailable: libibverbs cannot be loaded here.
	ErrUnavailable = errors.New("libibverbs unavailable")
	// ErrNoDevice: libibverbs loaded but no usable RDMA port was found.
	ErrNoDevice = errors.New("no usable RDMA device")
)

// Verbs is a loaded libibverbs.
type Verbs struct {
	v *C.struct_mcg_verbs
	// Optional entry points this library has.
	DmabufMR, IOVA2MR, GIDEx, ExtendedQP bool
}

// Load opens libibverbs at path (DefaultLibrary if empty): all required
// symbols or an error.
func Load(path string) (*Verbs, error) {
	t, err := dl.Load(path, DefaultLibrary, unsafe.Sizeof(C.struct_mcg_verbs{}), func(path, table, msg unsafe.Pointer, n int) int {
		return int(C.mcg_verbs_load((*C.char)(path), (*C.struct_mcg_verbs)(table), (*C.char)(msg), C.size_t(n)))
	})
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	v := (*C.struct_mcg_verbs)(t)
	return &Verbs{v: v, DmabufMR: v.reg_dmabuf_mr != nil, IOVA2MR: v.reg_mr_iova2 != nil,
		GIDEx: v.query_gid_ex != nil, ExtendedQP: v.qp_to_qp_ex != nil}, nil
}

var forkInit sync.Once

// ForkInit calls ibv_fork_init once per process, before any registration
// (as NCCL does), so that registered memory stays intact in a host program
// that forks (the children still cannot use mcguard itself).
func (v *Verbs) ForkInit() {
	forkInit.Do(func() { C.mcg_verbs_fork_init(v.v) })
}

// Port is one port of one RDMA device.
type Port struct {
	Device    string
	Port      int
	Active    bool
	RoCE      bool // Ethernet link layer; otherwise InfiniBand
	ActiveMTU int  // enum ibv_mtu: 1 = 256 ... 5 = 4096
}

// Ports lists every port of every device. A kernel without RDMA support
// makes ibv_get_device_list fail with ENOSYS: that is "no devices", an
// ErrNoDevice naming the reason, not a crash.
func (v *Verbs) Ports() ([]Port, error) {
	ports := make([]C.struct_mcg_port, 64)
	n := C.mcg_verbs_probe(v.v, &ports[0], C.int(len(ports)))
	if n < 0 {
		errno := syscall.Errno(-n)
		if errno == syscall.ENOSYS {
			return nil, fmt.Errorf("%w: the kernel has no RDMA support (ibv_get_device_list: %v)", ErrNoDevice, errno)
		}
		return nil, fmt.Errorf("%w: ibv_get_device_list: %v", ErrNoDevice, errno)
	}
	out := make([]Port, n)
	for i := range out {
		p := ports[i]
		out[i] = Port{Device: C.GoString(&p.device[0]), Port: int(p.port), Active: p.active != 0,
			RoCE: p.link_layer == C.IBV_LINK_LAYER_ETHERNET, ActiveMTU: int(p.active_mtu)}
	}
	return out, nil
}

// loaded is one library path's load and probe, done once per process:
// libraries and devices do not come and go under a guard.
type loaded struct {
	v      *Verbs
	err    error
	ports  []Port // active ports
	perr   error
	probed bool
}

var (
	loadMu sync.Mutex
	libs   = map[string]*loaded{}
)

func shared(path string) *loaded {
	if path == "" {
		path = DefaultLibrary
	}
	loadMu.Lock()
	defer loadMu.Unlock()
	l, ok := libs[path]
	if !ok {
		l = &loaded{}
		l.v, l.err = Load(path)
		libs[path] = l
	}
	return l
}

// Shared returns the library at path (DefaultLibrary if empty), loaded
// once per process however many guards use it.
func Shared(path string) (*Verbs, error) {
	l := shared(path)
	return l.v, l.err
}

// Probe returns the active ports of the shared library at path, or why
// there are none, found once per process.
func Probe(path string) ([]Port, error) {
	l := shared(path)
	if l.err != nil {
		return nil, l.err
	}
	loadMu.Lock()
	defer loadMu.Unlock()
	if !l.probed {
		l.ports, l.perr = activePorts(l.v)
		l.probed = true
	}
	return l.ports, l.perr
}

func activePorts(v *Verbs) ([]Port, error) {
	ports, err := v.Ports()
	if err != nil {
		return nil, err
	}
	var active []Port
	for _, p := range ports {
		if p.Active {
			active = append(active, p)
		}
	}
	if len(active) == 0 {
		return nil, fmt.Errorf("%w: %d port(s) found, none active", ErrNoDevice, len(ports))
	}
	return active, nil
}
