"""get_local_topology: Mooncake's form, read from sysfs."""

import json
import os

from mcguard.mooncake import GuardedTransferEngine
from mcguard.integrations.topology import local_topology


def make_sysfs(root, nodes, devices):
    for n in nodes:
        os.makedirs(os.path.join(root, "devices", "system", "node", "node%d" % n))
    for name, numa in devices.items():
        d = os.path.join(root, "class", "infiniband", name, "device")
        os.makedirs(d)
        if numa is not None:
            with open(os.path.join(d, "numa_node"), "w") as f:
                f.write("%d\n" % numa)
    return str(root)


def test_devices_are_grouped_by_numa_node(tmp_path):
    sysfs = make_sysfs(tmp_path, [0, 1], {"mlx5_0": 0, "mlx5_1": 1, "mlx5_2": 1, "odd": None})
    assert json.loads(local_topology(sysfs=sysfs)) == {
        "cpu:0": [["mlx5_0"], ["mlx5_1", "mlx5_2", "odd"]],
        "cpu:1": [["mlx5_1", "mlx5_2"], ["mlx5_0", "odd"]],
    }
    assert json.loads(local_topology("mlx5_1, mlx5_0", sysfs=sysfs)) == {
        "cpu:0": [["mlx5_0"], ["mlx5_1"]],
        "cpu:1": [["mlx5_1"], ["mlx5_0"]],
    }


def test_no_rdma_no_numa_information(tmp_path):
    assert json.loads(local_topology(sysfs=str(tmp_path))) == {"cpu:0": [[], []]}


def test_engine_reports_this_machine_before_initialize():
    topo = json.loads(GuardedTransferEngine().get_local_topology())
    assert topo and all(k.startswith("cpu:") for k in topo)
    for preferred, others in topo.values():
        assert isinstance(preferred, list) and isinstance(others, list)
