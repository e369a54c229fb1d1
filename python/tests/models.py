"""Where the software models of hardware are: the CUDA driver model and the
RDMA NIC model that `make build` builds once. Each is found through one
variable, MCGUARD_CUDA_MODEL and MCGUARD_NIC_MODEL, which default to the
repository's build/ folder (as the Go tests' core/internal/models does)."""

import os

_BUILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "build")


def _find(variable, name):
    path = os.path.abspath(os.environ.get(variable) or os.path.join(_BUILD, name))
    if not os.path.exists(path):
        raise FileNotFoundError("the model %s is not built at %s: run `make build` in the mcguard "
                                "repository, or set %s" % (name, path, variable))
    return path


def cuda_model_path():
    """The CUDA driver model library (tests/cudamodel)."""
    return _find("MCGUARD_CUDA_MODEL", "libcudamodel.so")


def nic_model_path():
    """The RDMA NIC model library (tests/nicmodel)."""
    return _find("MCGUARD_NIC_MODEL", "libnicmodel.so")
