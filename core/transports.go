package core

import (
	"fmt"

	"github.com/mcguard/mcguard/core/config"
	"github.com/mcguard/mcguard/core/cuda"
	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/core/fault"
	"github.com/mcguard/mcguard/core/logs"
	"github.com/mcguard/mcguard/core/memory"
	"github.com/mcguard/mcguard/core/transport"
	"github.com/mcguard/mcguard/core/transport/engine"
	"github.com/mcguard/mcguard/core/transport/rdma"
	"github.com/mcguard/mcguard/core/transport/tcp"
)

// dataPlanes are the data planes a guard can send over, in the order that
// transport "auto" tries them. Adding one is an entry here, its settings
// in PlaneSettings, and a folder under core/transport. TCP comes last and every guard serves it: it is
// the fallback, and peers whose own data plane is TCP reach any guard.
var dataPlanes = []struct {
	name  string
	named bool // opened only where the configuration names it, never by auto
	open  func(g *Guard, host string) (transport.Transport, error)
}{
	{engine.Name, true, func(g *Guard, _ string) (transport.Transport, error) {
		if g.openEngine == nil {
			return nil, fmt.Errorf("%w: transport engine is the application's own engine, handed over with mc_guard_open_with_transport", errs.Config)
		}
		p, err := g.openEngine(g)
		if err != nil {
			return nil, err
		}
		g.engine = p
		return p, nil
	}},
	{rdma.Name, false, func(g *Guard, _ string) (transport.Transport, error) {
		return rdma.Open(rdma.Config{Settings: g.cfg.Planes.RDMA, Timeout: g.cfg.Timeout, GPU: g.regions.GPU(),
			Joined: &g.stats.joined})
	}},
	{tcp.Name, false, func(g *Guard, host string) (transport.Transport, error) {
		faults := g.cfg.Inject
		if g.engine != nil {
			faults = fault.Config{} // injected at the engine's callbacks instead
		}
		t, err := tcp.New(tcp.Config{Host: host, Timeout: g.cfg.Timeout, Regions: g.regions, Tokens: g.auth.Tokens.Sender,
			Faults: faults, TailBytes: g.cfg.Verify.TailBytes, Notice: g.takeNotice, SameHost: g.cfg.SameHost, MACReplies: len(g.cfg.Secret) > 0,
			SameHostWriter: g.cfg.SameHostWriter, Pushed: &g.stats.pushed, Mapped: &g.stats.mapped, Joined: &g.stats.joined,
			DigestAtLanding: g.cfg.DigestAt == "landing", Settings: g.cfg.Planes.TCP,
			Refused: func(reason string) { g.metrics.refusedWrites.Add(1, reason) }})
		if err != nil {
			return nil, err
		}
		g.takeRingNotices = t.TakeRingNotices // same-host senders' notices, taken when a sync looks for one
		return t, nil
	}},
}

// PlaneSettings are each data plane's own settings, which its package
// declares and reads (Settings.Load).
type PlaneSettings struct {
	TCP    tcp.Settings
	RDMA   rdma.Settings
	Engine engine.Settings
}

func defaultPlaneSettings() PlaneSettings {
	return PlaneSettings{TCP: tcp.DefaultSettings(), RDMA: rdma.DefaultSettings(), Engine: engine.DefaultSettings()}
}

func (p *PlaneSettings) load(l *config.Loader) {
	p.RDMA.Load(l)
	p.TCP.Load(l)
	p.Engine.Load(l)
}

// openDataPlanes opens TCP, and the data plane cfg.Transport names (auto:
// the first of dataPlanes that opens), and says which and why: where a
// named one fails the guard fails with the reason; where auto falls back
// to TCP it logs why, once per process.
func (g *Guard) openDataPlanes(host string) error {
	var why []string
	for _, dp := range dataPlanes {
		if dp.name != tcp.Name && g.cfg.Transport != dp.name && (g.cfg.Transport != "auto" || dp.named) {
			g.planeState[dp.name] = "not probed (transport " + g.cfg.Transport + ")"
			continue
		}
		if g.data != nil && dp.name != tcp.Name {
			g.planeState[dp.name] = "not opened (transport " + g.data.Name() + " came first)"
			continue
		}
		p, err := dp.open(g, host)
		if err != nil {
			g.planeState[dp.name] = err.Error()
			if dp.name == tcp.Name || g.cfg.Transport == dp.name {
				g.closeDataPlanes()
				if dp.name == tcp.Name {
					return err
				}
				return fmt.Errorf("%w: transport %s was required, and it is not usable: %v", errs.Config, dp.name, err)
			}
			why = append(why, dp.name+": "+err.Error())
			continue
		}
		g.planes = append(g.planes, p)
		g.planeState[dp.name] = p.Describe()
		if g.data == nil {
			g.data = p
		}
	}
	if g.cfg.Transport == "auto" && g.data.Name() == tcp.Name && len(why) > 0 {
		// The probe is the same for every guard of the process: say it once.
		autoFallbackLogged.Printf(logs.Info, "transport auto: using tcp, because: %v", why)
	}
	return nil
}

var autoFallbackLogged logs.Once

// handshakeTransport is the data plane a handshake names: the one the
// guard sends over, or over an engine TCP, which every guard serves (the
// handshake is then for the control channel only, and offers nothing).
func (g *Guard) handshakeTransport() string {
	if g.engine != nil {
		return tcp.Name
	}
	return g.data.Name()
}

// setRegions makes r this guard's region table.
func (g *Guard) setRegions(r *memory.Regions) {
	g.regions = r
	g.view = r.View // a method value, made once: each use would allocate it again
}

// loadCUDA finds the driver as cfg.CUDA says; the region table reaches
// device memory through it.
func (g *Guard) loadCUDA() error {
	g.setRegions(memory.New(nil))
	if g.cfg.CUDA == "off" {
		g.cudaState = "off"
		return nil
	}
	d, err := cuda.Shared(g.cfg.CUDALibrary)
	if err != nil {
		if g.cfg.CUDA == "required" {
			return fmt.Errorf("%w: cuda is required: %v", errs.Device, err)
		}
		g.cudaState = "unavailable: " + err.Error()
		return nil
	}
	g.setRegions(memory.New(d))
	g.cudaState = fmt.Sprintf("driver %d", d.Version)
	return nil
}
