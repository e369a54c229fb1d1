/* Compile test: the public header and the cgo-generated one declare the
 * same types and can be included together, in C and (header_agree.cpp) C++.
 * shim.c, which includes both, is the check that the prototypes agree. */
#include "mcguard.h"
#include "libmcguard.h"

int main(void) {
    mc_status (*open_fn)(const char *, mc_guard_t *) = mc_guard_open;
    mc_status (*go_open)(char *, mc_guard_t *) = mcgOpen;
    return (open_fn != nullptr && go_open != nullptr) ? 0 : 1;
}
