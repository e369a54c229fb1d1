package samehost

import (
	"fmt"
	"os"
	"strings"
	"sync"

	"golang.org/x/sys/unix"
)

// Yama: under kernel.yama.ptrace_scope 1 a process may read another's
// memory (process_vm_readv) only if it is an ancestor of it or was named
// by it with prctl(PR_SET_PTRACER). The target reads the sender, so the
// sender names the target's pid before proving itself. A process can name
// one ptracer at a time (with its descendants); a sender that already
// named another live target sends through the socket to the next one
// rather than take the grant away from the first. Scope 2 and 3 allow
// no such grant.

var (
	yamaScopePath = "/proc/sys/kernel/yama/ptrace_scope"
	setPtracer    = func(pid int) error { return unix.Prctl(unix.PR_SET_PTRACER, uintptr(pid), 0, 0, 0) }
	pidAlive      = func(pid int) bool { return unix.Kill(pid, 0) != unix.ESRCH }

	ptracerMu sync.Mutex
	ptracer   int // the pid this process named, 0: none
)

// GrantPtrace lets process pid read this one where Yama requires it; it
// returns why it cannot, or "".
func GrantPtrace(pid int) string {
	b, err := os.ReadFile(yamaScopePath)
	if err != nil {
		return "" // no Yama: ordinary ptrace rules (same user) apply
	}
	switch scope := strings.TrimSpace(string(b)); scope {
	case "0":
		return ""
	case "1":
	default:
		return fmt.Sprintf("kernel.yama.ptrace_scope is %s: only a process with CAP_SYS_PTRACE may read another's memory", scope)
	}
	if pid <= 0 {
		return "kernel.yama.ptrace_scope is 1 and the receiver did not say its pid"
	}
	if pid == os.Getpid() {
		return "" // a process reads itself
	}
	ptracerMu.Lock()
	defer ptracerMu.Unlock()
	if ptracer == pid {
		return ""
	}
	if ptracer != 0 && pidAlive(ptracer) {
		return fmt.Sprintf("kernel.yama.ptrace_scope is 1 and this process already lets receiver %d read it (one at a time)", ptracer)
	}
	if err := setPtracer(pid); err != nil {
		return fmt.Sprintf("kernel.yama.ptrace_scope is 1 and prctl(PR_SET_PTRACER, %d) failed: %v", pid, err)
	}
	ptracer = pid
	return ""
}
