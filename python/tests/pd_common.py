"""What the two-process prefill/decode harnesses (vllm_pd, sglang_pd)
share: the plugin's distribution metadata for a framework's plugin loader,
ports, a spawned process's settings, and waiting for a process's answer."""

import os
import socket
import sys
import tempfile
import time

PYTHON_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def plugin_metadata(group):
    """A folder with mcguard's distribution metadata (its entry point in
    group, from pyproject.toml), as an editable install writes it: the
    framework finds the plugin in the working tree through
    importlib.metadata. It goes first on the path: an older egg-info of
    mcguard's in the tree would otherwise be the one found. The caller
    removes it."""
    root = os.path.dirname(PYTHON_DIR)
    with open(os.path.join(root, "pyproject.toml")) as f:
        text = f.read()
    entry = text.split('[project.entry-points."%s"]' % group, 1)[1].strip().splitlines()[0]
    d = tempfile.mkdtemp(prefix="mcguard-plugin-")
    info = os.path.join(d, "mcguard-0.0.0.dist-info")
    os.mkdir(info)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: mcguard\nVersion: 0.0.0\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        f.write("[%s]\n%s\n" % (group, entry.replace('"', "")))
    return d


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def take_env(env):
    """A spawned process's settings, its path included (it started with
    the parent's)."""
    os.environ.update(env)
    for p in reversed(env["PYTHONPATH"].split(os.pathsep)):
        if p and p not in sys.path:
            sys.path.insert(0, p)


def expect(conn, proc, what, timeout):
    """The next message on conn, which must be what, within timeout s; an
    error naming the process where it exits or is silent first."""
    deadline = time.monotonic() + timeout
    while not conn.poll(0.2):
        if not proc.is_alive():
            raise RuntimeError("the %s process exited (status %s) before %r" % (proc.name, proc.exitcode, what))
        if time.monotonic() > deadline:
            raise RuntimeError("no %r from the %s process in %d s" % (what, proc.name, timeout))
    msg = conn.recv()
    if msg[0] != what:
        raise RuntimeError("expected %r, got %r" % (what, msg[:1]))
    return msg
