package samehost

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

// This kernel has no Yama, so the grant's logic runs against a scope file
// and a prctl of the test's own; the real prctl is one system call.
func fakeYama(t *testing.T, scope string) (granted *[]int, alive map[int]bool) {
	dir := t.TempDir()
	path := filepath.Join(dir, "ptrace_scope")
	if scope != "" {
		require.NoError(t, os.WriteFile(path, []byte(scope+"\n"), 0o644))
	}
	granted = new([]int)
	alive = map[int]bool{}
	oldPath, oldSet, oldAlive := yamaScopePath, setPtracer, pidAlive
	yamaScopePath = path
	setPtracer = func(pid int) error {
		if pid == 666 {
			return errors.New("EINVAL")
		}
		*granted = append(*granted, pid)
		return nil
	}
	pidAlive = func(pid int) bool { return alive[pid] }
	ptracer = 0
	t.Cleanup(func() { yamaScopePath, setPtracer, pidAlive, ptracer = oldPath, oldSet, oldAlive, 0 })
	return granted, alive
}

func TestYamaGrant(t *testing.T) {
	t.Run("no Yama, or scope 0: nothing to grant", func(t *testing.T) {
		for _, scope := range []string{"", "0"} {
			granted, _ := fakeYama(t, scope)
			require.Empty(t, GrantPtrace(1234))
			require.Empty(t, *granted)
		}
	})
	t.Run("scope 1: the receiver is named, once", func(t *testing.T) {
		granted, alive := fakeYama(t, "1")
		require.Empty(t, GrantPtrace(1234))
		require.Empty(t, GrantPtrace(1234))
		require.Equal(t, []int{1234}, *granted)
		alive[1234] = true
		require.Contains(t, GrantPtrace(5678), "already lets receiver 1234 read it", "one ptracer at a time: the first keeps it")
		delete(alive, 1234)
		require.Empty(t, GrantPtrace(5678), "the first receiver is gone: the grant moves")
		require.Equal(t, []int{1234, 5678}, *granted)
		require.Empty(t, GrantPtrace(os.Getpid()), "a process reads itself")
		require.Contains(t, GrantPtrace(0), "did not say its pid")
		delete(alive, 5678)
		require.Contains(t, GrantPtrace(666), "prctl(PR_SET_PTRACER, 666) failed")
	})
	t.Run("scope 2 and 3: no grant can help", func(t *testing.T) {
		for _, scope := range []string{"2", "3"} {
			granted, _ := fakeYama(t, scope)
			require.Contains(t, GrantPtrace(1234), "CAP_SYS_PTRACE")
			require.Empty(t, *granted)
		}
	})
}
