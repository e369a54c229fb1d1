// Package cbuild compiles the C software models the tests run on (the CUDA
// driver model, the RDMA NIC model) into shared libraries, once per
// process.
package cbuild

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
)

type result struct {
	path string
	err  error
}

var (
	mu    sync.Mutex
	built = map[string]result{}
)

// Library compiles source (a C file) into a shared library in a temporary
// directory, or returns the one built before for the same source.
func Library(source string) (string, error) {
	abs, err := filepath.Abs(source)
	if err != nil {
		return "", err
	}
	mu.Lock()
	defer mu.Unlock()
	if r, ok := built[abs]; ok {
		return r.path, r.err
	}
	r := result{}
	dir, err := os.MkdirTemp("", "mcguard-model")
	if err == nil {
		r.path = filepath.Join(dir, "lib"+filepath.Base(abs[:len(abs)-len(filepath.Ext(abs))])+".so")
		cc := os.Getenv("CC")
		if cc == "" {
			cc = "cc"
		}
		if out, cerr := exec.Command(cc, "-shared", "-fPIC", "-O2", "-o", r.path, abs, "-lpthread", "-ldl").CombinedOutput(); cerr != nil {
			err = fmt.Errorf("building %s: %v: %s", source, cerr, out)
		}
	}
	r.err = err
	built[abs] = r
	return r.path, r.err
}
