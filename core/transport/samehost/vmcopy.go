package samehost

// process_vm_writev and process_vm_readv for same-host writes and reads:
// short copies continued, IOV_MAX pairs per call, large batches over
// several goroutines.

import (
	"fmt"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// maxIov is the iovecs one process_vm_writev call takes (IOV_MAX).
const maxIov = 1024

// Copy copies local[i] to or from remote[i] in process pid, continuing
// short copies, IOV_MAX pairs per call; both sides' lengths match pairwise.
func Copy(pid int, local []unix.Iovec, remote []unix.RemoteIovec, write bool) error {
	for {
		for len(local) > 0 && local[0].Len == 0 { // an empty pair (a dropped write) at the front
			local, remote = local[1:], remote[1:]
		}
		if len(local) == 0 {
			return nil
		}
		k := min(len(local), maxIov)
		var n int
		var err error
		if write {
			n, err = unix.ProcessVMWritev(pid, local[:k], remote[:k], 0)
		} else {
			n, err = unix.ProcessVMReadv(pid, local[:k], remote[:k], 0)
		}
		if err == syscall.EINTR {
			continue
		}
		if err != nil {
			return err
		}
		if n == 0 {
			return syscall.EFAULT
		}
		// Skip the pairs done, and cut into the one done partly.
		for n > 0 && len(local) > 0 {
			l := int(local[0].Len)
			if n >= l {
				n -= l
				local, remote = local[1:], remote[1:]
				continue
			}
			local[0].Base = (*byte)(unsafe.Add(unsafe.Pointer(local[0].Base), n))
			local[0].SetLen(l - n)
			remote[0].Base += uintptr(n)
			remote[0].Len -= n
			n = 0
		}
	}
}

// vmPair is one pair of Copy's slices, for InRuns.
type vmPair struct {
	l unix.Iovec
	r unix.RemoteIovec
}

// CopyParallel writes the pairs with Copy, on several goroutines where
// the batch is large (InRuns); the first error wins.
func CopyParallel(pid int, local []unix.Iovec, remote []unix.RemoteIovec, total uint64) error {
	k := Threads(total)
	if k == 1 {
		return Copy(pid, local, remote, true)
	}
	pairs := make([]vmPair, len(local))
	for i := range local {
		pairs[i] = vmPair{local[i], remote[i]}
	}
	size := func(p vmPair) int { return int(p.l.Len) }
	split := func(p vmPair, n int) (vmPair, vmPair) {
		head, tail := p, p
		head.l.SetLen(n)
		head.r.Len = n
		tail.l.Base = (*byte)(unsafe.Add(unsafe.Pointer(p.l.Base), n))
		tail.l.SetLen(int(p.l.Len) - n)
		tail.r.Base += uintptr(n)
		tail.r.Len -= n
		return head, tail
	}
	return InRuns(pairs, total, k, size, split, func(run []vmPair) error {
		l, r := make([]unix.Iovec, len(run)), make([]unix.RemoteIovec, len(run))
		for i, p := range run {
			l[i], r[i] = p.l, p.r
		}
		return Copy(pid, l, r, true)
	})
}

// ReadSpans reads remote spans of process pid into local pieces: the
// spans' bytes, in order, fill the pieces in order (their totals match),
// so that one span fills several pieces, the bytes between them going to
// a piece that is thrown away. The kernel's cost is mostly per remote
// iovec (about 0.5 µs each for 64 bytes on a 2-core VM, 0.65 for 4 KiB),
// so a few pieces near one another read as one span cost a fraction of
// reading each. Whole spans per call, IOV_MAX iovecs on either side; a
// span may fill at most IOV_MAX pieces. A short read is an error: only a
// fault in the target's memory ends one early.
func ReadSpans(pid int, local []unix.Iovec, remote []unix.RemoteIovec) error {
	for len(remote) > 0 {
		nl, nr, want := 0, 0, 0
		for nr < len(remote) && nr < maxIov {
			k, need := 0, remote[nr].Len
			for need > 0 && nl+k < len(local) {
				need -= int(local[nl+k].Len)
				k++
			}
			if need != 0 {
				return fmt.Errorf("the pieces do not fill span %d", nr)
			}
			if nl+k > maxIov {
				break
			}
			nl, want, nr = nl+k, want+remote[nr].Len, nr+1
		}
		if nr == 0 {
			return fmt.Errorf("a span of more than %d pieces", maxIov)
		}
		n, err := unix.ProcessVMReadv(pid, local[:nl], remote[:nr], 0)
		if err == syscall.EINTR {
			continue
		}
		if err != nil {
			return err
		}
		if n != want {
			return fmt.Errorf("read %d of %d bytes: %w", n, want, syscall.EFAULT)
		}
		local, remote = local[nl:], remote[nr:]
	}
	return nil
}

// Read copies [addr, addr+len(b)) of process pid into b, continuing short
// copies.
func Read(pid int, addr uint64, b []byte) error {
	if len(b) == 0 {
		return nil
	}
	local := []unix.Iovec{{Base: &b[0]}}
	local[0].SetLen(len(b))
	return Copy(pid, local, []unix.RemoteIovec{{Base: uintptr(addr), Len: len(b)}}, false)
}
