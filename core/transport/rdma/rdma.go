// Package rdma is the RDMA data plane: RC queue pairs over libibverbs
// (core/transport/rdma/verbs). The target side (this file) registers every
// region as a memory region and connects a queue pair of its own to each
// of a sender's; the sender's side (conn.go) stripes WRITEs over its queue
// pairs and fences each one, with the FLUSH verb where both ends have it,
// else a READ.
package rdma

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/mcguard/mcguard/core/cuda"
	"github.com/mcguard/mcguard/core/errs"
	"github.com/mcguard/mcguard/core/memory"
	"github.com/mcguard/mcguard/core/transport"
	"github.com/mcguard/mcguard/core/transport/rdma/verbs"
)

// Name is the data plane's name in handshakes.
const Name = "rdma"

// MaxQPs bounds the queue pairs of one session (rdma_qps).
const MaxQPs = 16

// maxTargetQPs bounds the queue pairs a target keeps for all its senders
// together: a flood of handshakes is refused, not served until the NIC
// runs out. A variable, for tests.
var maxTargetQPs = 1024

// qpDepth is the send depth of each queue pair.
const qpDepth = 256

// Config is what the RDMA data plane needs of its guard.
type Config struct {
	Settings
	Timeout time.Duration // bounds every completion wait
	GPU     *cuda.Driver  // for GPU regions (dmabuf export); nil: none
	// Joined, if set, counts the descriptors that went inside another
	// descriptor's WRITE (consecutive ones joined).
	Joined *atomic.Int64
}

// Transport is a guard's RDMA data plane: the endpoint, a memory region
// per registered region (host or GPU), and on the target side the queue
// pairs of each sender.
type Transport struct {
	cfg   Config
	ep    *verbs.Endpoint
	mu    sync.Mutex
	mrs   map[uint64]*verbs.MR   // by region start
	mems  map[uint64]cuda.Memory // where each region's bytes live, to register it again
	peers map[string][]*verbs.QP // by sender id
}

// Open loads libibverbs (once per process), finds an active port and
// opens it, or says why it cannot.
func Open(cfg Config) (*Transport, error) {
	if _, err := verbs.Probe(cfg.Library); err != nil {
		return nil, err
	}
	v, err := verbs.Shared(cfg.Library)
	if err != nil {
		return nil, err
	}
	v.ForkInit()
	ep, err := v.Open(cfg.Device, cfg.GIDIndex)
	if err != nil {
		return nil, err
	}
	return &Transport{cfg: cfg, ep: ep, mrs: map[uint64]*verbs.MR{}, mems: map[uint64]cuda.Memory{}, peers: map[string][]*verbs.QP{}}, nil
}

func (*Transport) Name() string { return Name }

// Describe names the device, the port and the fence.
func (t *Transport) Describe() string {
	fence := "READ (the device has no FLUSH verb)"
	if t.ep.Flush() {
		fence = "FLUSH verb"
	}
	return fmt.Sprintf("rdma on %s port %d, fence %s", t.ep.Device(), t.ep.Port(), fence)
}

// GID is the endpoint's port GID (tests address the model with it).
func (t *Transport) GID() [16]byte { return t.ep.GID() }

// Register makes [addr, addr+n) a memory region. GPU memory goes as a
// dmabuf where the verbs library, the CUDA driver and the device all do
// it, else as a plain registration of the device pointer, which the
// kernel accepts where nvidia-peermem is loaded; neither is an
// MC_ERR_DEVICE that says what each lacked.
func (t *Transport) Register(addr, n uint64, mem cuda.Memory) error {
	mr, err := t.register(addr, n, mem)
	if err != nil {
		return err
	}
	t.mu.Lock()
	t.mrs[addr], t.mems[addr] = mr, mem
	t.mu.Unlock()
	return nil
}

func (t *Transport) register(addr, n uint64, mem cuda.Memory) (*verbs.MR, error) {
	if mem.Device {
		return t.registerDevice(addr, n, mem)
	}
	mr, err := t.ep.Register(addr, n)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", errs.InvalidArg, err)
	}
	return mr, nil
}

func (t *Transport) registerDevice(addr, n uint64, mem cuda.Memory) (*verbs.MR, error) {
	err := fmt.Errorf("no CUDA driver")
	if t.cfg.GPU != nil {
		var fd int
		var offset uint64
		if fd, offset, err = t.cfg.GPU.Dmabuf(addr, n, mem); err == nil {
			mr, rerr := t.ep.RegisterDmabuf(fd, offset, n, addr)
			syscall.Close(fd) // the registration holds the dmabuf now
			if rerr == nil {
				return mr, nil
			}
			err = rerr
		}
	}
	mr, perr := t.ep.Register(addr, n)
	if perr == nil {
		return mr, nil
	}
	return nil, fmt.Errorf("%w: GPU memory [%#x, +%d) cannot be registered for RDMA: as a dmabuf: %v; as a plain registration (needs nvidia-peermem): %v",
		errs.Device, addr, n, err, perr)
}

// Unregister deregisters the memory region of the region at addr.
func (t *Transport) Unregister(addr uint64) error {
	t.mu.Lock()
	mr := t.mrs[addr]
	delete(t.mrs, addr)
	delete(t.mems, addr)
	t.mu.Unlock()
	if mr != nil {
		t.ep.Deregister(mr)
	}
	return nil
}

// offer is a sender's part of the handshake: its queue pairs, one per
// stripe (none: it only refreshes its region table).
type offer struct {
	QPs []verbs.QPInfo `json:"qps,omitempty"`
}

// answer is the target's: a queue pair of its own for each of the
// sender's, an rkey per region of the reply (0: not reachable over RDMA),
// and whether its regions take the FLUSH verb.
type answer struct {
	QPs   []verbs.QPInfo `json:"qps,omitempty"`
	RKeys []uint32       `json:"rkeys"`
	Flush bool           `json:"flush,omitempty"`
}

// Accept connects a queue pair of ours to each of the sender's, replacing
// those an earlier handshake of the same sender made, and lists the rkeys.
func (t *Transport) Accept(peer transport.Peer, raw []byte, regions []memory.Region) ([]byte, error) {
	var o offer
	if len(raw) > 0 {
		if err := json.Unmarshal(raw, &o); err != nil {
			return nil, fmt.Errorf("malformed rdma offer: %v", err)
		}
	}
	if len(o.QPs) > MaxQPs {
		return nil, fmt.Errorf("%d queue pairs asked for, at most %d", len(o.QPs), MaxQPs)
	}
	a := answer{RKeys: t.rkeys(regions), Flush: t.ep.Flush()}
	if len(o.QPs) > 0 {
		infos, err := t.accept(peer.Sender, o.QPs)
		if err != nil {
			return nil, fmt.Errorf("cannot connect queue pairs to the peer's: %v", err)
		}
		a.QPs = infos
	}
	return json.Marshal(a)
}

func (t *Transport) accept(sender string, remotes []verbs.QPInfo) ([]verbs.QPInfo, error) {
	t.mu.Lock()
	held := 0
	for id, old := range t.peers {
		if id != sender { // a sender's own are replaced
			held += len(old)
		}
	}
	t.mu.Unlock()
	if held+len(remotes) > maxTargetQPs {
		return nil, fmt.Errorf("this guard holds %d queue pairs for other senders; %d more would pass its limit of %d", held, len(remotes), maxTargetQPs)
	}
	qps, infos, err := t.newQPs(len(remotes))
	if err != nil {
		return nil, err
	}
	for i, remote := range remotes {
		if err := qps[i].Connect(remote); err != nil {
			destroyQPs(qps)
			return nil, err
		}
	}
	t.mu.Lock()
	destroyQPs(t.peers[sender])
	t.peers[sender] = qps
	t.mu.Unlock()
	return infos, nil
}

// newQPs makes n queue pairs and their descriptions for the peer.
func (t *Transport) newQPs(n int) ([]*verbs.QP, []verbs.QPInfo, error) {
	qps := make([]*verbs.QP, 0, n)
	infos := make([]verbs.QPInfo, n)
	for i := range infos {
		qp, err := t.ep.NewQP(qpDepth)
		if err != nil {
			destroyQPs(qps)
			return nil, nil, err
		}
		qps = append(qps, qp)
		infos[i] = qp.Info()
	}
	return qps, infos, nil
}

// rkeys returns the rkey of each region (0: not reachable over RDMA).
func (t *Transport) rkeys(regions []memory.Region) []uint32 {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make([]uint32, len(regions))
	for i, rg := range regions {
		if mr := t.mrs[rg.Addr]; mr != nil {
			out[i] = mr.RKey
		}
	}
	return out
}

// Quiesce takes the memory regions that hold ranges away from the NIC and
// registers them again under new rkeys: once the old ones are
// deregistered, no WRITE under them can land (it completes in error at its
// sender), wherever it was queued. A sender learns the new rkeys when it
// reconnects: its first transfer after the quiesce fails with the remote
// access error, as the aborted one does.
func (t *Transport) Quiesce(_ context.Context, ranges []memory.Region) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	for addr, mr := range t.mrs {
		held := memory.Region{Addr: addr, Len: mr.Len}
		if !overlapsAny(held, ranges) {
			continue
		}
		fresh, err := t.register(addr, mr.Len, t.mems[addr])
		if err != nil {
			return fmt.Errorf("registering [%#x, +%d) again: %w", addr, mr.Len, err)
		}
		t.ep.Deregister(mr)
		t.mrs[addr] = fresh
	}
	return nil
}

func overlapsAny(r memory.Region, ranges []memory.Region) bool {
	for _, q := range ranges {
		if r.Overlaps(q) {
			return true
		}
	}
	return false
}

// Abort destroys the queue pairs this target keeps for the peer: the NIC
// executes nothing more that arrives for them.
func (t *Transport) Abort(peer transport.Peer) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	destroyQPs(t.peers[peer.Sender])
	delete(t.peers, peer.Sender)
	return nil
}

// Stats: the RDMA data plane adds nothing of its own (its queue pairs
// count in Connections).
func (t *Transport) Stats(map[string]any) {}

// Connections counts the queue pairs kept for senders.
func (t *Transport) Connections() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	n := 0
	for _, qps := range t.peers {
		n += len(qps)
	}
	return n
}

// Settle has nothing to wait for: the NIC writes without this CPU, and
// what makes its writes safe to read is the sender's fence and, for GPU
// memory, the guard's flush that follows.
func (*Transport) Settle(context.Context, []memory.Region) error { return nil }

func destroyQPs(qps []*verbs.QP) {
	for _, qp := range qps {
		qp.Destroy()
	}
}

// Close destroys every sender's queue pairs, deregisters every region and
// closes the device.
func (t *Transport) Close() {
	t.mu.Lock()
	for id, qps := range t.peers {
		destroyQPs(qps)
		delete(t.peers, id)
	}
	for addr, mr := range t.mrs {
		t.ep.Deregister(mr)
		delete(t.mrs, addr)
	}
	t.mu.Unlock()
	t.ep.Close()
}

// Dial makes the session's queue pairs; their descriptions are the offer.
func (t *Transport) Dial() (transport.Dialer, error) {
	qps, infos, err := t.newQPs(t.cfg.QPs)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", errs.Peer, err)
	}
	o, _ := json.Marshal(offer{QPs: infos})
	return &dialer{t: t, qps: qps, offer: o}, nil
}

type dialer struct {
	t     *Transport
	qps   []*verbs.QP
	offer []byte
}

func (d *dialer) Offer() []byte { return d.offer }
func (d *dialer) Abandon()      { destroyQPs(d.qps) }

// Connect finishes the session's queue pairs with the target's answer.
func (d *dialer) Connect(_ context.Context, _ transport.Peer, raw []byte, regions []memory.Region) (transport.Conn, error) {
	var a answer
	if err := json.Unmarshal(raw, &a); err != nil {
		d.Abandon()
		return nil, fmt.Errorf("%w: malformed rdma answer: %v", errs.Session, err)
	}
	return connect(d.t, d.qps, a, regions)
}

var (
	_ transport.Transport = (*Transport)(nil)
	_ transport.Conn      = (*conn)(nil)
)
