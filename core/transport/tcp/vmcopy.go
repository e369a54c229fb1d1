package tcp

// process_vm_writev and process_vm_readv for same-host pushes and reads:
// short copies continued, IOV_MAX pairs per call, large batches over
// several goroutines.

import (
	"runtime"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// maxIov is the iovecs one process_vm_writev call takes (IOV_MAX).
const maxIov = 1024

// vmCopy copies local[i] to or from remote[i] in process pid, continuing
// short copies, IOV_MAX pairs per call; both sides' lengths match pairwise.
func vmCopy(pid int, local []unix.Iovec, remote []unix.RemoteIovec, write bool) error {
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

// parallelMin is the batch from which a push is split over several
// threads: the kernel pins the target's pages in every call, so one thread
// copies at about half of memcpy's speed, and the target's CPU takes no
// part. Below it a thread hand-off costs more than it saves.
const parallelMin = 4 << 20

// vmCopyParallel writes the pairs with vmCopy, cut by bytes into
// contiguous runs (a pair may be cut in two) over up to GOMAXPROCS (at
// most 4) goroutines where the batch is large; the first error wins.
// copyParallel cuts memcpy pairs the same way.
func vmCopyParallel(pid int, local []unix.Iovec, remote []unix.RemoteIovec, total uint64) error {
	k := min(runtime.GOMAXPROCS(0), 4)
	if total < parallelMin || k < 2 {
		return vmCopy(pid, local, remote, true)
	}
	results := make(chan error, k)
	runs := 0
	share := int((total + uint64(k) - 1) / uint64(k))
	for len(local) > 0 {
		var l []unix.Iovec
		var r []unix.RemoteIovec
		for need := share; need > 0 && len(local) > 0; {
			n := int(local[0].Len)
			if n <= need {
				l, r = append(l, local[0]), append(r, remote[0])
				local, remote = local[1:], remote[1:]
				need -= n
				continue
			}
			// Cut the pair: its first need bytes go in this run.
			head := local[0]
			head.SetLen(need)
			l, r = append(l, head), append(r, unix.RemoteIovec{Base: remote[0].Base, Len: need})
			local[0].Base = (*byte)(unsafe.Add(unsafe.Pointer(local[0].Base), need))
			local[0].SetLen(n - need)
			remote[0].Base += uintptr(need)
			remote[0].Len -= need
			need = 0
		}
		runs++
		go func() { results <- vmCopy(pid, l, r, true) }()
	}
	var first error
	for ; runs > 0; runs-- {
		if err := <-results; err != nil && first == nil {
			first = err
		}
	}
	return first
}
