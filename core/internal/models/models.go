// Package models finds the software models of hardware that the tests run
// the real loaders on: the CUDA driver model (tests/cudamodel) and the RDMA
// NIC model (tests/nicmodel). `make build` builds them, once; tests find
// each through one variable, MCGUARD_CUDA_MODEL and MCGUARD_NIC_MODEL,
// which default to the repository's build/ folder.
package models

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"testing"
)

// CUDA is the path of the CUDA driver model library.
func CUDA() (string, error) { return find("MCGUARD_CUDA_MODEL", "libcudamodel.so") }

// NIC is the path of the RDMA NIC model library.
func NIC() (string, error) { return find("MCGUARD_NIC_MODEL", "libnicmodel.so") }

func find(variable, name string) (string, error) {
	path := os.Getenv(variable)
	if path == "" {
		_, here, _, _ := runtime.Caller(0)
		path = filepath.Join(filepath.Dir(here), "..", "..", "..", "build", name)
	}
	path, err := filepath.Abs(path)
	if err != nil {
		return "", err
	}
	if _, err := os.Stat(path); err != nil {
		return "", fmt.Errorf("the model %s is not built (run `make build`, or set %s): %v", name, variable, err)
	}
	return path, nil
}

// NICFor is NIC for a test: it fails the test, naming the reason, when
// the model is not built.
func NICFor(t testing.TB) string {
	t.Helper()
	path, err := NIC()
	if err != nil {
		t.Fatal(err)
	}
	return path
}
