// Package heap returns the C heap's free memory to the system. libzmq
// allocates a pipe and buffers per connection from the C heap; after a
// flood of connections glibc keeps what they freed unless asked.
package heap

/*
#include <malloc.h>
*/
import "C"

// Trim gives the C heap's free pages back to the system.
func Trim() { C.malloc_trim(0) }
