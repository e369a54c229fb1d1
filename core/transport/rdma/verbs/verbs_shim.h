/* The libibverbs entry points mcguard uses, as one table filled at run time
 * (dlopen + dlvsym of the versioned symbols): libmcguard never links
 * libibverbs. Written against the real <infiniband/verbs.h>. Declarations
 * only: cgo copies this into generated code. */
#ifndef MCGUARD_VERBS_SHIM_H
#define MCGUARD_VERBS_SHIM_H
#include <stddef.h>
#include <infiniband/verbs.h>

struct mcg_verbs {
    void *lib;
    /* required */
    struct ibv_device **(*get_device_list)(int *);
    void (*free_device_list)(struct ibv_device **);
    const char *(*get_device_name)(struct ibv_device *);
    struct ibv_context *(*open_device)(struct ibv_device *);
    int (*close_device)(struct ibv_context *);
    int (*query_device)(struct ibv_context *, struct ibv_device_attr *);
    int (*query_port)(struct ibv_context *, uint8_t, struct ibv_port_attr *);
    int (*query_gid)(struct ibv_context *, uint8_t, int, union ibv_gid *);
    struct ibv_pd *(*alloc_pd)(struct ibv_context *);
    int (*dealloc_pd)(struct ibv_pd *);
    struct ibv_mr *(*reg_mr)(struct ibv_pd *, void *, size_t, int);
    int (*dereg_mr)(struct ibv_mr *);
    struct ibv_cq *(*create_cq)(struct ibv_context *, int, void *, struct ibv_comp_channel *, int);
    int (*destroy_cq)(struct ibv_cq *);
    struct ibv_qp *(*create_qp)(struct ibv_pd *, struct ibv_qp_init_attr *);
    int (*destroy_qp)(struct ibv_qp *);
    int (*modify_qp)(struct ibv_qp *, struct ibv_qp_attr *, int);
    int (*fork_init)(void);
    /* optional, newer: NULL when this libibverbs lacks them */
    struct ibv_mr *(*reg_dmabuf_mr)(struct ibv_pd *, uint64_t, size_t, uint64_t, int, int);
    struct ibv_mr *(*reg_mr_iova2)(struct ibv_pd *, void *, size_t, uint64_t, unsigned int);
    int (*query_gid_ex)(struct ibv_context *, uint32_t, uint32_t, struct ibv_gid_entry *, uint32_t, size_t);
    struct ibv_qp_ex *(*qp_to_qp_ex)(struct ibv_qp *);
};

/* 0, or -1 with a message in err. */
int mcg_verbs_load(const char *path, struct mcg_verbs *v, char *err, size_t errlen);

/* One port of one device, as the probe saw it. */
struct mcg_port {
    char device[64];
    int port;
    int active;      /* IBV_PORT_ACTIVE */
    int link_layer;  /* IBV_LINK_LAYER_INFINIBAND or _ETHERNET (RoCE) */
    int active_mtu;  /* enum ibv_mtu */
};

/* Lists up to max ports of every device; returns how many, or -errno when
 * ibv_get_device_list fails (-ENOSYS: the kernel has no RDMA support). */
int mcg_verbs_probe(struct mcg_verbs *v, struct mcg_port *ports, int max);
int mcg_verbs_fork_init(struct mcg_verbs *v);
#endif
