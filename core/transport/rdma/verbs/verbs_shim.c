// Loading libibverbs: one table, all-or-nothing for the required entry
// points, each looked up at its symbol version (IBVERBS_1.1: the 1.0
// symbols are ABI compatibility shims), the newer ones flagged optional.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "verbs_shim.h"

int mcg_verbs_load(const char *path, struct mcg_verbs *v, char *err, size_t errlen) {
    memset(v, 0, sizeof *v);
    v->lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!v->lib) {
        snprintf(err, errlen, "cannot load %s: %s", path, dlerror());
        return -1;
    }
#define SYM(field, name, version, required)                                                       \
    do {                                                                                          \
        void *p = dlvsym(v->lib, name, version);                                                  \
        if (!p) p = dlsym(v->lib, name); /* a library without symbol versions (a model) */        \
        if (!p && required) {                                                                     \
            snprintf(err, errlen, "%s lacks %s@%s: not a usable libibverbs", path, name, version); \
            dlclose(v->lib);                                                                      \
            memset(v, 0, sizeof *v);                                                              \
            return -1;                                                                            \
        }                                                                                         \
        memcpy(&v->field, &p, sizeof p);                                                          \
    } while (0)
    SYM(get_device_list, "ibv_get_device_list", "IBVERBS_1.1", 1);
    SYM(free_device_list, "ibv_free_device_list", "IBVERBS_1.1", 1);
    SYM(get_device_name, "ibv_get_device_name", "IBVERBS_1.1", 1);
    SYM(open_device, "ibv_open_device", "IBVERBS_1.1", 1);
    SYM(close_device, "ibv_close_device", "IBVERBS_1.1", 1);
    SYM(query_device, "ibv_query_device", "IBVERBS_1.1", 1);
    SYM(query_port, "ibv_query_port", "IBVERBS_1.1", 1);
    SYM(query_gid, "ibv_query_gid", "IBVERBS_1.1", 1);
    SYM(alloc_pd, "ibv_alloc_pd", "IBVERBS_1.1", 1);
    SYM(dealloc_pd, "ibv_dealloc_pd", "IBVERBS_1.1", 1);
    SYM(reg_mr, "ibv_reg_mr", "IBVERBS_1.1", 1);
    SYM(dereg_mr, "ibv_dereg_mr", "IBVERBS_1.1", 1);
    SYM(create_cq, "ibv_create_cq", "IBVERBS_1.1", 1);
    SYM(destroy_cq, "ibv_destroy_cq", "IBVERBS_1.1", 1);
    SYM(create_qp, "ibv_create_qp", "IBVERBS_1.1", 1);
    SYM(destroy_qp, "ibv_destroy_qp", "IBVERBS_1.1", 1);
    SYM(modify_qp, "ibv_modify_qp", "IBVERBS_1.1", 1);
    SYM(fork_init, "ibv_fork_init", "IBVERBS_1.1", 1);
    SYM(reg_dmabuf_mr, "ibv_reg_dmabuf_mr", "IBVERBS_1.12", 0);
    SYM(reg_mr_iova2, "ibv_reg_mr_iova2", "IBVERBS_1.8", 0);
    SYM(query_gid_ex, "_ibv_query_gid_ex", "IBVERBS_1.11", 0);
    SYM(qp_to_qp_ex, "ibv_qp_to_qp_ex", "IBVERBS_1.6", 0);
#undef SYM
    return 0;
}

int mcg_verbs_probe(struct mcg_verbs *v, struct mcg_port *ports, int max) {
    int ndev = 0, n = 0;
    errno = 0;
    struct ibv_device **list = v->get_device_list(&ndev);
    if (!list) return errno ? -errno : -ENODEV;
    for (int i = 0; i < ndev && n < max; i++) {
        struct ibv_context *ctx = v->open_device(list[i]);
        if (!ctx) continue;
        struct ibv_device_attr dattr;
        if (v->query_device(ctx, &dattr) == 0) {
            for (int p = 1; p <= dattr.phys_port_cnt && n < max; p++) {
                struct ibv_port_attr pattr;
                memset(&pattr, 0, sizeof pattr);
                if (v->query_port(ctx, (uint8_t)p, &pattr) != 0) continue;
                struct mcg_port *out = &ports[n++];
                snprintf(out->device, sizeof out->device, "%s", v->get_device_name(list[i]));
                out->port = p;
                out->active = pattr.state == IBV_PORT_ACTIVE;
                out->link_layer = pattr.link_layer;
                out->active_mtu = pattr.active_mtu;
            }
        }
        v->close_device(ctx);
    }
    v->free_device_list(list);
    return n;
}

int mcg_verbs_fork_init(struct mcg_verbs *v) { return v->fork_init(); }
