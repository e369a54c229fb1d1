package rdma

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/core/internal/models"
	"github.com/mcguard/mcguard/core/transport"
	"github.com/mcguard/mcguard/core/transport/rdma/verbs"
)

func TestTargetQueuePairsAreBounded(t *testing.T) {
	nic := models.NICFor(t)
	old := maxTargetQPs
	maxTargetQPs = 8
	t.Cleanup(func() { maxTargetQPs = old })
	tr, err := Open(Config{Settings: Settings{Library: nic, GIDIndex: -1, QPs: 1}, Timeout: time.Second})
	require.NoError(t, err)
	defer tr.Close()
	qp := verbs.QPInfo{QPN: 7, GID: tr.GID()} // a GID the model answers to
	accept := func(sender string, n int) error {
		qps := make([]verbs.QPInfo, n)
		for i := range qps {
			qps[i] = qp
		}
		o, _ := json.Marshal(offer{QPs: qps})
		_, err := tr.Accept(transport.Peer{Sender: sender}, o, nil)
		return err
	}
	require.NoError(t, accept("a", 4))
	require.NoError(t, accept("b", 4))
	require.NoError(t, accept("a", 4), "a sender's own queue pairs are replaced, not added")
	err = accept("c", 1)
	require.Error(t, err)
	require.Contains(t, err.Error(), "would pass its limit of 8")
	require.NoError(t, accept("b", 4), "the others still connect")
}
