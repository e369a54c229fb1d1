// Package samehost is what any data plane needs to move bytes between two
// processes on one machine without a socket: which host and process each
// end is (the handshake's offer compared, the kernel's word on the
// sender's pid, SO_PEERCRED), the grants a receiver keeps for proven
// senders, Yama's ptrace grant, and the cross-memory copies
// (process_vm_readv and process_vm_writev, large ones split over
// threads). The TCP data plane uses it for its same-host path; its frames
// and the lease that lets a sender write into the receiver stay there.
package samehost
