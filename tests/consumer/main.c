/* Opens a guard through an installed libmcguard and checks its version. */
#include <stdio.h>
#include <string.h>

#include <mcguard.h>

int main(void) {
    mc_guard_t g = 0;
    if (mc_guard_open(NULL, &g) != MC_OK) return 1;
    if (strcmp(mc_guard_version(), MC_GUARD_VERSION_STRING) != 0) return 2;
    if (mc_guard_close(g) != MC_OK) return 3;
    puts("consumer: ok");
    return 0;
}
