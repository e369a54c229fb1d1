/* The verbs data path in C: queue pairs, work requests and completions live
 * in C memory, and ibv_post_send / ibv_poll_cq (inline in verbs.h, through
 * the context's ops) are called here, never from Go. */
#ifndef MCGUARD_QP_SHIM_H
#define MCGUARD_QP_SHIM_H
#include <stdint.h>
#include "verbs_shim.h"
#include "flush_abi.h"

struct mcg_endpoint {
    struct mcg_verbs *v;
    struct ibv_context *ctx;
    struct ibv_pd *pd;
    uint8_t port;
    int gid_index;
    union ibv_gid gid;
    enum ibv_mtu mtu;
    int flush; /* the device does the FLUSH verb (global visibility): MRs and QPs allow it */
};

/* Opens device (NULL: the first with an active port) and picks the GID:
 * gid_index >= 0 names it; -1 picks the first RoCE v2 GID where the
 * library can tell GID types (ibv_query_gid_ex), else index 0. 0 or -1
 * with err. */
int mcg_ep_open(struct mcg_verbs *v, const char *device, int gid_index, struct mcg_endpoint *ep, char *err,
                size_t errlen);
void mcg_ep_close(struct mcg_endpoint *ep);
struct ibv_mr *mcg_ep_reg(struct mcg_endpoint *ep, void *addr, size_t len);
/* GPU memory exported as a dmabuf: [offset, offset+len) of fd, seen by
 * peers at iova. NULL with errno (ENOSYS: the library lacks
 * ibv_reg_dmabuf_mr). */
struct ibv_mr *mcg_ep_reg_dmabuf(struct mcg_endpoint *ep, uint64_t offset, size_t len, uint64_t iova, int fd);
int mcg_ep_dereg(struct mcg_endpoint *ep, struct ibv_mr *mr);
uint32_t mcg_mr_lkey(struct ibv_mr *mr);
uint32_t mcg_mr_rkey(struct ibv_mr *mr);

/* A queue pair with a completion queue of its own, so that waits on two
 * queue pairs never take each other's completions. On a FLUSH-capable
 * endpoint it is an extended QP that can post FLUSH, and *flush says
 * whether the provider gave it that (an older provider refuses the
 * send op, and the QP is made without it). */
struct ibv_qp *mcg_qp_create(struct mcg_endpoint *ep, int depth, int *flush);
void mcg_qp_destroy(struct mcg_endpoint *ep, struct ibv_qp *qp);
uint32_t mcg_qp_num(struct ibv_qp *qp);
/* RESET -> INIT -> RTR -> RTS towards (remote_qpn, remote_gid). 0 or errno. */
int mcg_qp_connect(struct mcg_endpoint *ep, struct ibv_qp *qp, uint32_t remote_qpn, const uint8_t *remote_gid,
                   uint32_t psn, uint32_t remote_psn);
int mcg_qp_reset(struct mcg_endpoint *ep, struct ibv_qp *qp);

/* Posts n RDMA WRITEs (or READs) as one chain; every signal_every-th and
 * the last are signaled (an RC queue completes in order), with
 * wr_id = wr_base + index. 0 or errno. */
int mcg_post_chain(struct ibv_qp *qp, int is_read, int n, const uint64_t *laddr, const uint32_t *lkey,
                   const uint64_t *raddr, const uint32_t *rkey, const uint32_t *len, uint64_t wr_base,
                   int signal_every);
/* Posts n FLUSHes (placement type global, selectivity range) through the
 * extended QP API, the last signaled, with wr_id = wr_base + index; each
 * returns once the QP's earlier writes to its range are globally visible
 * at the target. 0 or errno. */
int mcg_post_flush(struct mcg_endpoint *ep, struct ibv_qp *qp, int n, const uint64_t *raddr, const uint32_t *rkey,
                   const uint64_t *len, uint64_t wr_base);
/* Polls up to max completions of qp: wr_ids and statuses (enum ibv_wc_status). */
int mcg_poll(struct ibv_qp *qp, int max, uint64_t *wr_ids, int *statuses);
const char *mcg_wc_status_str(int status);
#endif
