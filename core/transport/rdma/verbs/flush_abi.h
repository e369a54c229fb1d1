/* The IBTA FLUSH verb as newer rdma-core exposes it (verbs.h of rdma-core
 * 45 and later, kernel uapi ib_user_ioctl_verbs.h). Debian's rdma-core 44
 * headers, which this project builds against, predate it, so the few
 * values are declared here; their ABI is fixed upstream:
 *   - struct ibv_qp_ex gained wr_flush right after wr_atomic_write;
 *   - IBV_ACCESS_FLUSH_GLOBAL, IBV_QP_EX_WITH_FLUSH, IBV_FLUSH_GLOBAL,
 *     IBV_FLUSH_RANGE, IB_UVERBS_DEVICE_FLUSH_GLOBAL (device_cap_flags_ex)
 *     and IBV_WC_FLUSH have the values below.
 * Shared by the transport and the NIC model, so both read one layout. */
#ifndef MCGUARD_FLUSH_ABI_H
#define MCGUARD_FLUSH_ABI_H
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <infiniband/verbs.h>

#define MCG_ACCESS_FLUSH_GLOBAL (1 << 8)
#define MCG_QP_EX_WITH_FLUSH (1ULL << 11)
#define MCG_DEVICE_FLUSH_GLOBAL (1ULL << 38)
#define MCG_FLUSH_GLOBAL 1 /* placement type: global visibility */
#define MCG_FLUSH_RANGE 0  /* selectivity: the given range */
#define MCG_WC_FLUSH 8     /* enum ibv_wc_opcode */

typedef void (*mcg_wr_flush_fn)(struct ibv_qp_ex *qp, uint32_t rkey, uint64_t remote_addr, size_t len, uint8_t type,
                                uint8_t level);

/* wr_flush's slot: the pointer after wr_atomic_write. */
#define MCG_WR_FLUSH_OFFSET (offsetof(struct ibv_qp_ex, wr_atomic_write) + sizeof(void (*)(void)))
_Static_assert(offsetof(struct ibv_qp_ex, wr_atomic_write) == 344, "struct ibv_qp_ex is not the rdma-core layout");

static inline mcg_wr_flush_fn mcg_qpx_wr_flush(struct ibv_qp_ex *qpx) {
    mcg_wr_flush_fn fn;
    memcpy(&fn, (char *)qpx + MCG_WR_FLUSH_OFFSET, sizeof fn);
    return fn;
}
#endif
