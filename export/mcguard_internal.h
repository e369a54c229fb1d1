/* Declarations shared by the Go exports and the C entry points in
 * shim.c. Declarations only: cgo copies this into the generated header. */
#ifndef MCGUARD_INTERNAL_H
#define MCGUARD_INTERNAL_H
#ifdef __cplusplus
extern "C" {
#endif
/* getenv of the live C environment (Go's os.Getenv sees a copy taken at load). */
const char *mcg_getenv(const char *name);
/* Calls a log sink (a C function pointer, which Go cannot call itself). */
void mcg_call_log(mc_log_fn fn, int32_t level, const char *message, void *ctx);
#ifdef __cplusplus
}
#endif
#endif
