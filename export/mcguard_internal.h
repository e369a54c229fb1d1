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
/* Call an engine's callbacks (C function pointers). */
mc_status mcg_call_batch(mc_transport_batch_fn fn, void *ctx, const char *session, const uint64_t *local,
                         const uint64_t *remote, const uint64_t *len, size_t n, char *msg, size_t msg_len);
mc_status mcg_call_register(mc_transport_register_fn fn, void *ctx, uint64_t addr, uint64_t len, char *msg,
                            size_t msg_len);
mc_status mcg_call_unregister(mc_transport_unregister_fn fn, void *ctx, uint64_t addr, char *msg, size_t msg_len);
mc_status mcg_call_fence(mc_transport_fence_fn fn, void *ctx, const char *session, char *msg, size_t msg_len);
#ifdef __cplusplus
}
#endif
#endif
