#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "qp_shim.h"

/* The first RoCE v2 GID of the port, or 0 when GID types are unknown. */
static int pick_gid(struct mcg_endpoint *ep) {
    if (!ep->v->query_gid_ex) return 0;
    for (uint32_t i = 0; i < 256; i++) {
        struct ibv_gid_entry e;
        if (ep->v->query_gid_ex(ep->ctx, ep->port, i, &e, 0, sizeof e) != 0) break;
        if (e.gid_type == IBV_GID_TYPE_ROCE_V2) return (int)i;
    }
    return 0;
}

/* Whether the device reports FLUSH with global visibility. The extended
 * device query is called through the context's ops, as verbs.h's inline
 * ibv_query_device_ex does, without its legacy fallback (which would
 * link ibv_query_device). */
static int probe_flush(struct mcg_endpoint *ep) {
    if (!ep->v->qp_to_qp_ex) return 0;
    struct verbs_context *vctx = verbs_get_ctx_op(ep->ctx, query_device_ex);
    if (!vctx) return 0;
    struct ibv_device_attr_ex a;
    memset(&a, 0, sizeof a);
    if (vctx->query_device_ex(ep->ctx, NULL, &a, sizeof a) != 0) return 0;
    return (a.device_cap_flags_ex & MCG_DEVICE_FLUSH_GLOBAL) != 0;
}

int mcg_ep_open(struct mcg_verbs *v, const char *device, int gid_index, struct mcg_endpoint *ep, char *err,
                size_t errlen) {
    memset(ep, 0, sizeof *ep);
    ep->v = v;
    int n = 0;
    struct ibv_device **list = v->get_device_list(&n);
    if (!list) {
        snprintf(err, errlen, "ibv_get_device_list: %s", strerror(errno));
        return -1;
    }
    for (int i = 0; i < n && !ep->ctx; i++) {
        if (device && strcmp(device, v->get_device_name(list[i])) != 0) continue;
        struct ibv_context *ctx = v->open_device(list[i]);
        if (!ctx) continue;
        struct ibv_device_attr dattr;
        if (v->query_device(ctx, &dattr) == 0) {
            for (int p = 1; p <= dattr.phys_port_cnt; p++) {
                struct ibv_port_attr pattr;
                memset(&pattr, 0, sizeof pattr);
                if (v->query_port(ctx, (uint8_t)p, &pattr) == 0 && pattr.state == IBV_PORT_ACTIVE) {
                    ep->ctx = ctx;
                    ep->port = (uint8_t)p;
                    ep->mtu = pattr.active_mtu;
                    break;
                }
            }
        }
        if (!ep->ctx) v->close_device(ctx);
    }
    v->free_device_list(list);
    if (!ep->ctx) {
        snprintf(err, errlen, device ? "device %s has no active port" : "no device with an active port", device);
        return -1;
    }
    ep->flush = probe_flush(ep);
    ep->gid_index = gid_index >= 0 ? gid_index : pick_gid(ep);
    if (v->query_gid(ep->ctx, ep->port, ep->gid_index, &ep->gid) != 0 || !(ep->pd = v->alloc_pd(ep->ctx))) {
        snprintf(err, errlen, "setting up the device: %s", strerror(errno));
        mcg_ep_close(ep);
        return -1;
    }
    return 0;
}

void mcg_ep_close(struct mcg_endpoint *ep) {
    if (ep->pd) ep->v->dealloc_pd(ep->pd);
    if (ep->ctx) ep->v->close_device(ep->ctx);
    ep->pd = NULL;
    ep->ctx = NULL;
}

static int access_flags(struct mcg_endpoint *ep) {
    return IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
           (ep->flush ? MCG_ACCESS_FLUSH_GLOBAL : 0);
}

struct ibv_mr *mcg_ep_reg(struct mcg_endpoint *ep, void *addr, size_t len) {
    return ep->v->reg_mr(ep->pd, addr, len, access_flags(ep));
}

struct ibv_mr *mcg_ep_reg_dmabuf(struct mcg_endpoint *ep, uint64_t offset, size_t len, uint64_t iova, int fd) {
    if (!ep->v->reg_dmabuf_mr) {
        errno = ENOSYS;
        return NULL;
    }
    errno = 0;
    return ep->v->reg_dmabuf_mr(ep->pd, offset, len, iova, fd, access_flags(ep));
}

int mcg_ep_dereg(struct mcg_endpoint *ep, struct ibv_mr *mr) { return ep->v->dereg_mr(mr); }
uint32_t mcg_mr_lkey(struct ibv_mr *mr) { return mr->lkey; }
uint32_t mcg_mr_rkey(struct ibv_mr *mr) { return mr->rkey; }

struct ibv_qp *mcg_qp_create(struct mcg_endpoint *ep, int depth, int *flush) {
    *flush = 0;
    struct ibv_cq *cq = ep->v->create_cq(ep->ctx, 2 * depth + 16, NULL, NULL, 0);
    if (!cq) return NULL;
    struct ibv_qp_init_attr_ex a;
    memset(&a, 0, sizeof a);
    a.send_cq = cq;
    a.recv_cq = cq;
    a.qp_type = IBV_QPT_RC;
    a.cap.max_send_wr = (uint32_t)depth;
    a.cap.max_recv_wr = 1;
    a.cap.max_send_sge = 1;
    a.cap.max_recv_sge = 1;
    a.pd = ep->pd;
    struct ibv_qp *qp = NULL;
    struct verbs_context *vctx = ep->flush ? verbs_get_ctx_op(ep->ctx, create_qp_ex) : NULL;
    if (vctx) {
        a.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
        a.send_ops_flags = IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_RDMA_READ | MCG_QP_EX_WITH_FLUSH;
        qp = vctx->create_qp_ex(ep->ctx, &a);
        struct ibv_qp_ex *qpx = qp ? ep->v->qp_to_qp_ex(qp) : NULL;
        *flush = qpx && mcg_qpx_wr_flush(qpx) && qpx->wr_start && qpx->wr_complete;
    }
    if (!qp) { /* the ibv_qp_init_attr prefix of the extended attributes */
        a.comp_mask = 0;
        a.send_ops_flags = 0;
        qp = ep->v->create_qp(ep->pd, (struct ibv_qp_init_attr *)&a);
    }
    if (!qp) ep->v->destroy_cq(cq);
    return qp;
}

void mcg_qp_destroy(struct mcg_endpoint *ep, struct ibv_qp *qp) {
    struct ibv_cq *cq = qp->send_cq;
    ep->v->destroy_qp(qp);
    ep->v->destroy_cq(cq);
}
uint32_t mcg_qp_num(struct ibv_qp *qp) { return qp->qp_num; }

int mcg_qp_connect(struct mcg_endpoint *ep, struct ibv_qp *qp, uint32_t remote_qpn, const uint8_t *remote_gid,
                   uint32_t psn, uint32_t remote_psn) {
    struct ibv_qp_attr a;
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_INIT;
    a.pkey_index = 0;
    a.port_num = ep->port;
    a.qp_access_flags = access_flags(ep);
    int r = ep->v->modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
    if (r) return r;
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_RTR;
    a.path_mtu = ep->mtu;
    a.dest_qp_num = remote_qpn;
    a.rq_psn = remote_psn;
    a.max_dest_rd_atomic = 16;
    a.min_rnr_timer = 12;
    a.ah_attr.is_global = 1;
    memcpy(a.ah_attr.grh.dgid.raw, remote_gid, 16);
    a.ah_attr.grh.sgid_index = (uint8_t)ep->gid_index;
    a.ah_attr.grh.hop_limit = 64;
    a.ah_attr.port_num = ep->port;
    r = ep->v->modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                                     IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
    if (r) return r;
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_RTS;
    a.timeout = 14;
    a.retry_cnt = 7;
    a.rnr_retry = 7;
    a.sq_psn = psn;
    a.max_rd_atomic = 16;
    return ep->v->modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                                        IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC);
}

int mcg_qp_reset(struct mcg_endpoint *ep, struct ibv_qp *qp) {
    struct ibv_qp_attr a;
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_RESET;
    return ep->v->modify_qp(qp, &a, IBV_QP_STATE);
}

int mcg_post_chain(struct ibv_qp *qp, int is_read, int n, const uint64_t *laddr, const uint32_t *lkey,
                   const uint64_t *raddr, const uint32_t *rkey, const uint32_t *len, uint64_t wr_base,
                   int signal_every) {
    struct ibv_send_wr *wrs = calloc((size_t)n, sizeof *wrs);
    struct ibv_sge *sges = calloc((size_t)n, sizeof *sges);
    if (!wrs || !sges) {
        free(wrs);
        free(sges);
        return ENOMEM;
    }
    for (int i = 0; i < n; i++) {
        sges[i].addr = laddr[i];
        sges[i].length = len[i];
        sges[i].lkey = lkey[i];
        wrs[i].wr_id = wr_base + (uint64_t)i;
        wrs[i].sg_list = &sges[i];
        wrs[i].num_sge = 1;
        wrs[i].opcode = is_read ? IBV_WR_RDMA_READ : IBV_WR_RDMA_WRITE;
        wrs[i].send_flags = ((i + 1) % signal_every == 0 || i == n - 1) ? IBV_SEND_SIGNALED : 0;
        wrs[i].wr.rdma.remote_addr = raddr[i];
        wrs[i].wr.rdma.rkey = rkey[i];
        wrs[i].next = i + 1 < n ? &wrs[i + 1] : NULL;
    }
    struct ibv_send_wr *bad = NULL;
    int r = ibv_post_send(qp, wrs, &bad);
    free(wrs);
    free(sges);
    return r;
}

int mcg_post_flush(struct mcg_endpoint *ep, struct ibv_qp *qp, int n, const uint64_t *raddr, const uint32_t *rkey,
                   const uint64_t *len, uint64_t wr_base) {
    struct ibv_qp_ex *qpx = ep->v->qp_to_qp_ex ? ep->v->qp_to_qp_ex(qp) : NULL;
    mcg_wr_flush_fn wr_flush = qpx ? mcg_qpx_wr_flush(qpx) : NULL;
    if (!wr_flush) return EOPNOTSUPP;
    ibv_wr_start(qpx);
    for (int i = 0; i < n; i++) {
        qpx->wr_id = wr_base + (uint64_t)i;
        qpx->wr_flags = i == n - 1 ? IBV_SEND_SIGNALED : 0;
        wr_flush(qpx, rkey[i], raddr[i], (size_t)len[i], MCG_FLUSH_GLOBAL, MCG_FLUSH_RANGE);
    }
    return ibv_wr_complete(qpx);
}

int mcg_poll(struct ibv_qp *qp, int max, uint64_t *wr_ids, int *statuses) {
    struct ibv_wc wc[64];
    if (max > 64) max = 64;
    int n = ibv_poll_cq(qp->send_cq, max, wc);
    for (int i = 0; i < n; i++) {
        wr_ids[i] = wc[i].wr_id;
        statuses[i] = wc[i].status;
    }
    return n;
}

const char *mcg_wc_status_str(int status) {
    switch (status) {
    case IBV_WC_SUCCESS: return "success";
    case IBV_WC_LOC_PROT_ERR: return "local protection error";
    case IBV_WC_WR_FLUSH_ERR: return "flushed (the QP is in error)";
    case IBV_WC_REM_ACCESS_ERR: return "remote access error (rkey or bounds)";
    case IBV_WC_RETRY_EXC_ERR: return "transport retries exceeded (peer unreachable)";
    case IBV_WC_REM_OP_ERR: return "remote operation error";
    default: return "error completion";
    }
}
