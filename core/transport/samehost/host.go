package samehost

import (
	"encoding/json"
	"os"
	"strings"
	"sync"
)

// Host is what a handshake compares: the kernel's boot id and a process's
// pid namespace, and the pid the process says it has (its word only: the
// identity socket proves it).
type Host struct {
	Boot  string `json:"boot"`
	PidNS string `json:"pidns"`
	Pid   int    `json:"pid"`
}

var (
	localOnce sync.Once
	localID   Host
	localWhy  string
)

// Local is this process's Host, or why there is none.
func Local() (Host, string) {
	localOnce.Do(func() {
		boot, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
		if err != nil {
			localWhy = "no boot id: " + err.Error()
			return
		}
		ns, err := os.Readlink("/proc/self/ns/pid")
		if err != nil {
			localWhy = "no pid namespace: " + err.Error()
			return
		}
		localID = Host{Boot: strings.TrimSpace(string(boot)), PidNS: ns, Pid: os.Getpid()}
	})
	return localID, localWhy
}

// Offer is a sender's handshake offer: where it runs; nil where it cannot
// tell.
func Offer() []byte {
	id, why := Local()
	if why != "" {
		return nil
	}
	b, _ := json.Marshal(id)
	return b
}

// Compare reads a sender's offer and says why it is not on this host (in
// this pid namespace), or "" with the pid it claims. "another host" and
// "another pid namespace" are not failures: same-host transfers simply do
// not apply.
func Compare(offer []byte) (pid int, why string) {
	var peer Host
	if err := json.Unmarshal(offer, &peer); err != nil || peer.Pid <= 0 {
		return 0, "the sender's offer is malformed"
	}
	me, lwhy := Local()
	switch {
	case lwhy != "":
		return 0, "the receiver cannot tell its host: " + lwhy
	case peer.Boot != me.Boot:
		return 0, NotThisHost
	case peer.PidNS != me.PidNS:
		return 0, NotThisPidNS
	}
	return peer.Pid, ""
}

// Why Compare found the sender elsewhere.
const (
	NotThisHost  = "another host"
	NotThisPidNS = "another pid namespace"
)
