package transport

import "sync"

// Each runs fn on the indices below n that want at once, one goroutine
// each, and returns the first error (by index). A lone index runs on the
// caller's goroutine: a session with one connection or queue pair makes
// no hand-off.
func Each(n int, want func(i int) bool, fn func(i int) error) error {
	var chosen []int
	for i := range n {
		if want(i) {
			chosen = append(chosen, i)
		}
	}
	if len(chosen) == 1 {
		return fn(chosen[0])
	}
	errs := make([]error, n)
	var wg sync.WaitGroup
	for _, i := range chosen {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = fn(i)
		}()
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}
