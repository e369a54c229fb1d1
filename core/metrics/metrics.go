// Package metrics keeps a guard's counters, gauges and histograms and
// writes them in the Prometheus text exposition format (version 0.0.4):
// names with the mcguard_ prefix, base units, _total for counters.
package metrics

import (
	"fmt"
	"io"
	"math"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
)

// family is one metric name with its help, type and labelled series.
type family struct {
	name, help, kind string
	labels           []string
	mu               sync.Mutex
	series           map[string]*series // by the joined label values
}

type series struct {
	values []string
	n      atomic.Int64   // counter; gauge
	sum    atomic.Uint64  // histogram: float64 bits of the sum
	counts []atomic.Int64 // histogram: per bucket, not cumulative
}

func (f *family) get(values []string) *series {
	if len(values) != len(f.labels) {
		panic(fmt.Sprintf("metrics: %s takes %d label values, got %d", f.name, len(f.labels), len(values)))
	}
	// The key is built on the stack and looked up without a copy (a hot
	// path: every transfer adds to several series); only a new series
	// allocates it.
	var buf [128]byte
	key := buf[:0]
	for i, v := range values {
		if i > 0 {
			key = append(key, 0xff)
		}
		key = append(key, v...)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	s, ok := f.series[string(key)]
	if !ok {
		s = &series{values: append([]string(nil), values...)}
		if f.kind == "histogram" {
			s.counts = make([]atomic.Int64, len(Buckets)+1)
		}
		f.series[string(key)] = s
	}
	return s
}

// Counter is a monotonic count, by labels.
type Counter struct{ f *family }

// Add adds n to the series of the label values.
func (c Counter) Add(n int64, values ...string) { c.f.get(values).n.Add(n) }

// Histogram counts observations into Buckets, by labels.
type Histogram struct{ f *family }

// Buckets are the histograms' upper bounds, in seconds: 10 µs to 10 s.
var Buckets = []float64{1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1, 3, 10}

// Observe records one value (seconds) in the series of the label values.
func (h Histogram) Observe(v float64, values ...string) {
	s := h.f.get(values)
	i := sort.SearchFloat64s(Buckets, v) // the first bound >= v
	s.counts[i].Add(1)
	for {
		old := s.sum.Load()
		if s.sum.CompareAndSwap(old, math.Float64bits(math.Float64frombits(old)+v)) {
			return
		}
	}
}

// Gauge is a value read when the metrics are written.
type gauge struct {
	name, help string
	read       func() int64
}

// Registry is one guard's metrics.
type Registry struct {
	families []*family
	gauges   []gauge
}

func (r *Registry) add(name, help, kind string, labels []string) *family {
	f := &family{name: name, help: help, kind: kind, labels: labels, series: map[string]*series{}}
	r.families = append(r.families, f)
	return f
}

// Counter declares a counter; its name must end in _total.
func (r *Registry) Counter(name, help string, labels ...string) Counter {
	return Counter{r.add(name, help, "counter", labels)}
}

// Histogram declares a histogram of seconds.
func (r *Registry) Histogram(name, help string, labels ...string) Histogram {
	return Histogram{r.add(name, help, "histogram", labels)}
}

// Gauge declares a gauge read by read.
func (r *Registry) Gauge(name, help string, read func() int64) {
	r.gauges = append(r.gauges, gauge{name, help, read})
}

// Write writes every metric in the text exposition format.
func (r *Registry) Write(w io.Writer) error {
	var b strings.Builder
	for _, g := range r.gauges {
		fmt.Fprintf(&b, "# HELP %s %s\n# TYPE %s gauge\n%s %d\n", g.name, g.help, g.name, g.name, g.read())
	}
	for _, f := range r.families {
		fmt.Fprintf(&b, "# HELP %s %s\n# TYPE %s %s\n", f.name, f.help, f.name, f.kind)
		f.mu.Lock()
		keys := make([]string, 0, len(f.series))
		for k := range f.series {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		all := make([]*series, len(keys))
		for i, k := range keys {
			all[i] = f.series[k]
		}
		f.mu.Unlock()
		for _, s := range all {
			labels := labelText(f.labels, s.values, "", "")
			if f.kind == "counter" {
				fmt.Fprintf(&b, "%s%s %d\n", f.name, labels, s.n.Load())
				continue
			}
			var cum int64
			for i, bound := range Buckets {
				cum += s.counts[i].Load()
				fmt.Fprintf(&b, "%s_bucket%s %d\n", f.name, labelText(f.labels, s.values, "le", formatBound(bound)), cum)
			}
			cum += s.counts[len(Buckets)].Load()
			fmt.Fprintf(&b, "%s_bucket%s %d\n", f.name, labelText(f.labels, s.values, "le", "+Inf"), cum)
			fmt.Fprintf(&b, "%s_sum%s %g\n", f.name, labels, math.Float64frombits(s.sum.Load()))
			fmt.Fprintf(&b, "%s_count%s %d\n", f.name, labels, cum)
		}
	}
	_, err := io.WriteString(w, b.String())
	return err
}

func formatBound(v float64) string { return fmt.Sprintf("%g", v) }

// labelText renders {k="v",...}, with an extra label when extraName is set.
func labelText(names, values []string, extraName, extraValue string) string {
	if len(names) == 0 && extraName == "" {
		return ""
	}
	parts := make([]string, 0, len(names)+1)
	for i, n := range names {
		parts = append(parts, n+`="`+labelEscaper.Replace(values[i])+`"`)
	}
	if extraName != "" {
		parts = append(parts, extraName+`="`+labelEscaper.Replace(extraValue)+`"`)
	}
	return "{" + strings.Join(parts, ",") + "}"
}

// labelEscaper escapes a label value as the text format wants it.
var labelEscaper = strings.NewReplacer(`\`, `\\`, `"`, `\"`, "\n", `\n`)
