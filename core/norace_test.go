package core

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// Every test here that skips under the race detector is run again without
// it by make test (the Makefile's NORACE_TESTS): a skip that nothing
// makes up for would let an allocation test never run at all, as
// TestBatchedTransferAllocatesNothing and TestControlFloodIsBounded once
// did.
func TestRaceSkippedTestsRunWithoutRace(t *testing.T) {
	mk, err := os.ReadFile(filepath.Join("..", "Makefile"))
	require.NoError(t, err)
	m := regexp.MustCompile(`(?m)^NORACE_TESTS := (.+)$`).FindSubmatch(mk)
	require.NotNil(t, m, "the Makefile lists NORACE_TESTS")
	listed := map[string]bool{}
	for _, name := range strings.Split(string(m[1]), "|") {
		listed[strings.TrimSpace(name)] = true
	}
	files, err := filepath.Glob("*_test.go")
	require.NoError(t, err)
	funcs := regexp.MustCompile(`(?m)^func (Test\w+)\(|^\s*if raceEnabled \{`)
	var skipped []string
	for _, f := range files {
		src, err := os.ReadFile(f)
		require.NoError(t, err)
		current := ""
		for _, hit := range funcs.FindAllSubmatch(src, -1) {
			if len(hit[1]) > 0 {
				current = string(hit[1])
			} else if current != "" {
				skipped = append(skipped, current)
			}
		}
	}
	require.NotEmpty(t, skipped, "the scan finds the race-skipped tests")
	for _, name := range skipped {
		require.True(t, listed[name], "%s skips under the race detector but make test never runs it without", name)
	}
}
