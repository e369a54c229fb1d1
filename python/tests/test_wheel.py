"""pip install: the wheel carries the library, the header and the CMake
and pkg-config files; installed into a fresh virtual environment it loads
its own library with no variable set, and moves hash-checked bytes between
two processes from outside the source tree; a C program builds against it
with pkg-config and CMake finds it."""

import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def run(cmd, **kw):
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=True,
                          timeout=600, **kw).stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MCGUARD_LIBRARY")}
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp / "dist"), REPO], env=env)
    wheels = list((tmp / "dist").glob("mcguard-*.whl"))
    assert len(wheels) == 1
    run([sys.executable, "-m", "venv", str(tmp / "venv")], env=env)
    run([str(tmp / "venv" / "bin" / "pip"), "install", "-q", "--no-index", str(wheels[0])], env=env)
    away = tmp / "elsewhere"  # not the source tree: nothing of it on the path
    away.mkdir()
    return tmp / "venv" / "bin", away, env


def test_the_installed_package_uses_its_own_library(installed):
    bin_dir, away, env = installed
    out = run([str(bin_dir / "python"), "-c", "import mcguard, mcguard._lib as l; print(mcguard.version()); "
               "print(l.library_path())"], cwd=away, env=env)
    version, path = out.split()
    assert version == run([str(bin_dir / "mcguard"), "version"], cwd=away, env=env).strip()
    assert path.startswith(str(bin_dir.parent)), "the library inside the installed package"
    fast = run([str(bin_dir / "python"), "-c", "import mcguard.guard as g; "
                "print(g._fast_transfer is not None and g._fast_sync_transfers is not None)"],
               cwd=away, env=env).strip()
    if os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")):
        assert fast == "True", "the wheel carries mcguard._fastcall (transfer and sync) where Python's headers are"
    plugins = run([str(bin_dir / "python"), "-c", "from importlib.metadata import entry_points; "
                   "print([e.value for e in entry_points(group='vllm.general_plugins')])"], cwd=away, env=env)
    assert "mcguard.integrations.vllm_plugin:register" in plugins, "vLLM finds the plugin"


def test_a_two_process_transfer_from_the_installed_package(installed):
    bin_dir, away, env = installed
    out = run([str(bin_dir / "mcguard"), "stress", "--seconds", "2", "--json", "--quiet", "--threads", "2",
               "--blocks", "64", "--batch", "16", "--block-bytes", "16384"], cwd=away, env=env)
    import json
    result = json.loads(out.strip().splitlines()[-1])
    assert result["ok"] > 0 and result["mismatches"] == 0 and result["failed"] == 0


def test_c_builds_find_it(installed, tmp_path):
    bin_dir, away, env = installed
    include = run([str(bin_dir / "mcguard"), "--include"], cwd=away, env=env).strip()
    assert os.path.exists(os.path.join(include, "mcguard.h"))
    pc = run([str(bin_dir / "mcguard"), "--pkgconfig-dir"], cwd=away, env=env).strip()
    flags = run(["pkg-config", "--cflags", "--libs", "mcguard"], env=dict(env, PKG_CONFIG_PATH=pc)).split()
    src = os.path.join(REPO, "tests", "consumer", "main.c")
    run(["cc", "-o", str(tmp_path / "consumer"), src] + flags)
    run([str(tmp_path / "consumer")], env=env)
    if shutil.which("cmake"):
        cmake_dir = run([str(bin_dir / "mcguard"), "--cmake-dir"], cwd=away, env=env).strip()
        run(["cmake", "-S", os.path.join(REPO, "tests", "consumer"), "-B", str(tmp_path / "cm"),
             "-Dmcguard_DIR=" + cmake_dir, "-DMCGUARD_WANT=" + run([str(bin_dir / "mcguard"), "version"], env=env).strip()],
            env=env)
        run(["cmake", "--build", str(tmp_path / "cm")], env=env)
        run([str(tmp_path / "cm" / "consumer")], env=env)
