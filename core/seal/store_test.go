package seal

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/mcguard/mcguard/core/errs"
)

// The store keeps at most MaxPublished seals and MaxPublishedBytes, the
// oldest going first; a name published again replaces its seal.
func TestStoreIsBoundedOldestFirst(t *testing.T) {
	var st Store
	for i := range MaxPublished + 10 {
		require.NoError(t, st.Put(fmt.Sprint(i), []byte{byte(i)}))
	}
	require.Equal(t, MaxPublished, st.Len())
	require.Nil(t, st.Get("0"))
	require.Nil(t, st.Get("9"))
	require.Equal(t, []byte{byte(10)}, st.Get("10"))
	require.NoError(t, st.Put("10", []byte("again")))
	require.Equal(t, []byte("again"), st.Get("10"))
	require.Equal(t, MaxPublished, st.Len())
	require.True(t, st.Remove("10"))
	require.False(t, st.Remove("10"))

	var big Store
	seal := make([]byte, MaxFetched)
	for i := range MaxPublishedBytes/MaxFetched + 3 {
		require.NoError(t, big.Put(fmt.Sprint(i), seal))
	}
	require.Equal(t, MaxPublishedBytes/MaxFetched, big.Len())
	require.Nil(t, big.Get("2"))

	require.ErrorIs(t, st.Put("", seal[:1]), errs.InvalidArg)
	require.ErrorIs(t, st.Put(string(make([]byte, MaxName+1)), seal[:1]), errs.InvalidArg)
	require.ErrorIs(t, st.Put("huge", make([]byte, MaxFetched+1)), errs.InvalidArg)
}
