package core

import (
	"fmt"

	"github.com/mcguard/mcguard/core/cuda"
	"github.com/mcguard/mcguard/core/errs"
)

// Register makes [addr, addr+n) usable as a source and writable by peers
// over every data plane the guard serves. With a CUDA driver, the driver
// says whether it is device memory (and of which device), once, here;
// every later access follows that.
func (g *Guard) Register(addr, n uint64) error {
	if err := g.enter(); err != nil {
		return err
	}
	defer g.leave()
	var mem cuda.Memory
	if gpu := g.regions.GPU(); gpu != nil && n > 0 && addr+n > addr {
		first, err := gpu.Classify(addr)
		if err != nil {
			return fmt.Errorf("%w: classifying %#x: %v", errs.Device, addr, err)
		}
		last, err := gpu.Classify(addr + n - 1)
		if err != nil {
			return fmt.Errorf("%w: classifying %#x: %v", errs.Device, addr+n-1, err)
		}
		if first != last {
			return fmt.Errorf("%w: [%#x, +%d) spans host and device memory, or two devices", errs.InvalidArg, addr, n)
		}
		mem = first
	}
	if err := g.regions.AddMemory(addr, n, mem); err != nil {
		return err
	}
	for i, p := range g.planes {
		if err := p.Register(addr, n, mem); err != nil {
			for _, done := range g.planes[:i] {
				done.Unregister(addr)
			}
			g.regions.Remove(addr)
			return err
		}
	}
	return nil
}

// RegisterDevice is Register for memory the caller says is on a GPU: with
// no usable driver that is an error instead of a wrong guess.
func (g *Guard) RegisterDevice(addr, n uint64) error {
	gpu := g.regions.GPU()
	if gpu == nil {
		return fmt.Errorf("%w: device memory at %#x, but CUDA is %s", errs.Device, addr, g.cudaState)
	}
	if m, err := gpu.Classify(addr); err != nil || !m.Device {
		return fmt.Errorf("%w: %#x is not device memory the CUDA driver knows", errs.Device, addr)
	}
	return g.Register(addr, n)
}

// Unregister removes the region that starts at addr, waiting for accesses
// in progress to finish.
func (g *Guard) Unregister(addr uint64) error {
	if err := g.enter(); err != nil {
		return err
	}
	defer g.leave()
	if err := g.regions.Remove(addr); err != nil {
		return err
	}
	var first error
	for _, p := range g.planes {
		if err := p.Unregister(addr); err != nil && first == nil {
			first = fmt.Errorf("%w: unregistering %#x: %s: %v", errs.Timeout, addr, p.Name(), err)
		}
	}
	return first
}
