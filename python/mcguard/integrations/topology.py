"""The local topology in Mooncake's get_local_topology form, from sysfs:
{"cpu:N": [[RDMA devices on NUMA node N], [the other devices]]} for each
NUMA node, the preferred devices first, as Mooncake's discovery lists them
(which devices a transfer from memory on that node should use)."""

import json
import os


def _numa_nodes(sysfs):
    base = os.path.join(sysfs, "devices", "system", "node")
    try:
        nodes = sorted(int(n[4:]) for n in os.listdir(base) if n.startswith("node") and n[4:].isdigit())
    except OSError:
        nodes = []
    return nodes or [0]


def _rdma_devices(sysfs):
    """{device: its NUMA node, or -1 where sysfs does not say}."""
    base = os.path.join(sysfs, "class", "infiniband")
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return {}
    out = {}
    for name in names:
        try:
            with open(os.path.join(base, name, "device", "numa_node")) as f:
                out[name] = int(f.read().strip())
        except (OSError, ValueError):
            out[name] = -1
    return out


def local_topology(device_name=None, sysfs="/sys"):
    """The topology JSON; device_name ("mlx5_0,mlx5_1") keeps only those."""
    devices = _rdma_devices(sysfs)
    wanted = [d.strip() for d in (device_name or "").split(",") if d.strip()]
    if wanted:
        devices = {d: n for d, n in devices.items() if d in wanted}
    topo = {}
    for node in _numa_nodes(sysfs):
        near = [d for d, n in devices.items() if n == node]
        topo["cpu:%d" % node] = [near, [d for d in devices if d not in near]]
    return json.dumps(topo)
