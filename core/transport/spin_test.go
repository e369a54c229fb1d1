package transport

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestSpinBackoffSkipsOneTwoFourWaitsAfterTwoUnpaidSpins(t *testing.T) {
	var s SpinBackoff
	var pattern []bool // whether each wait spins, none paying
	for range 16 {
		spins := !s.Skipping()
		pattern = append(pattern, spins)
		if spins {
			s.Paid(false)
		}
	}
	require.Equal(t, []bool{true, true, false, true, true, false, false, true, true, false, false, false, false, true, true, false}, pattern)
}

func TestSpinBackoffEndsWithASpinThatPaysAndOneUnpaidSpinDoesNotBackOff(t *testing.T) {
	var s SpinBackoff
	for range 6 {
		s.Paid(false)
	}
	require.Equal(t, SpinBackoff{skip: 4, back: 8}, s)
	for s.Skipping() {
	}
	s.Paid(true)
	require.Equal(t, SpinBackoff{}, s, "a spin that pays: back to spinning every wait")
	s.Paid(false)
	require.False(t, s.Skipping(), "one unpaid spin: still spinning")
	s.Paid(true)
	s.Paid(false)
	require.False(t, s.Skipping(), "a paying spin between unpaid ones resets their run")
}

func TestSpinBackoffIsBounded(t *testing.T) {
	var s SpinBackoff
	for range 100 {
		s.Paid(false)
	}
	require.LessOrEqual(t, s.skip, MaxSpinBackoff)
	require.LessOrEqual(t, s.back, MaxSpinBackoff)
}
