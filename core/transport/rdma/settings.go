package rdma

import "github.com/mcguard/mcguard/core/config"

// Settings are the RDMA data plane's own settings, as an operator sets them.
type Settings struct {
	Library  string // libibverbs to load ("": the system's)
	Device   string // "": the first device with an active port
	GIDIndex int    // -1: the first RoCE v2 GID
	QPs      int    // queue pairs per session that a batch's writes are striped over, 1 to MaxQPs
}

// DefaultSettings are the settings where nothing is set.
func DefaultSettings() Settings { return Settings{GIDIndex: -1, QPs: 1} }

// Load reads verbs_library, rdma_device, rdma_gid_index and rdma_qps
// (MC_GUARD_VERBS_LIBRARY, ...) over s.
func (s *Settings) Load(l *config.Loader) {
	l.String("verbs_library", []string{"MC_GUARD_VERBS_LIBRARY"}, &s.Library)
	l.String("rdma_device", []string{"MC_GUARD_RDMA_DEVICE"}, &s.Device)
	l.Int("rdma_gid_index", []string{"MC_GUARD_RDMA_GID_INDEX"}, &s.GIDIndex, -1, 255)
	l.Int("rdma_qps", []string{"MC_GUARD_RDMA_QPS"}, &s.QPs, 1, MaxQPs)
}
