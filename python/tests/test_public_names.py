"""What users import and run today keeps working, whatever moves inside
the package: the names, the entry points, the modules run with -m, and
no import circle (each module imports on its own, in a fresh
interpreter)."""

import importlib
import os
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
ENV = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))

NAMES = {
    "mcguard": ["Guard", "MCGuardError", "TransferResult", "STATUS_NAMES", "version", "Engine", "MooncakeEngine",
                "MC_OK", "MC_ERR_TIMEOUT", "MC_ERR_VERIFY", "MC_ERR_QUIESCED"],
    "mcguard.guard": ["Guard", "MCGuardError", "TransferResult", "STATUS_NAMES", "VERIFY_MODES", "address_of",
                      "MC_OK", "MC_ERR_BAD_HANDLE", "MC_ERR_TIMEOUT", "MC_ERR_NO_MEMORY"],
    "mcguard.engine": ["Engine", "MooncakeEngine", "EngineError"],
    "mcguard.mooncake": ["GuardedTransferEngine"],
    "mcguard.metrics": ["Collector"],
    "mcguard.vllm_plugin": ["register"],
    "mcguard.sglang_plugin": ["register"],
    "mcguard.stress": ["main"],
    "mcguard.cli": ["main"],
}


@pytest.mark.parametrize("module", sorted(NAMES))
def test_the_names_users_import_stay(module):
    if module == "mcguard.metrics":
        pytest.importorskip("prometheus_client")
    m = importlib.import_module(module)
    missing = [n for n in NAMES[module] if not hasattr(m, n)]
    assert not missing, "%s lost %s" % (module, missing)


def test_entry_points_name_what_exists():
    text = open(os.path.join(ROOT, "pyproject.toml")).read()
    for target in ("mcguard.cli:main", "mcguard.vllm_plugin:register", "mcguard.sglang_plugin:register"):
        assert target in text
        module, name = target.split(":")
        assert callable(getattr(importlib.import_module(module), name))


@pytest.mark.parametrize("module", ["mcguard.stress", "mcguard.bench", "mcguard.demo", "mcguard.peerbench",
                                    "mcguard.devicecheck", "mcguard.cli"])
def test_modules_run_with_dash_m_answer_help(module):
    p = subprocess.run([sys.executable, "-m", module, "--help"], env=ENV, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "usage" in p.stdout.lower() or "mcguard" in p.stdout


def test_every_module_imports_alone():
    """An import circle shows as a module that fails to import first."""
    pkg = os.path.join(ROOT, "python", "mcguard")
    modules = sorted(f[:-3] for f in os.listdir(pkg) if f.endswith(".py") and f != "__init__.py")
    for name in modules:
        if name == "metrics":
            try:
                import prometheus_client  # noqa: F401
            except ImportError:
                continue
        p = subprocess.run([sys.executable, "-c", "import mcguard.%s" % name], env=ENV, capture_output=True,
                           text=True, timeout=60)
        assert p.returncode == 0, "mcguard.%s: %s" % (name, p.stderr[-2000:])


@pytest.mark.parametrize("command", ["stress", "bench", "demo"])
def test_a_subcommand_of_the_mcguard_command_names_itself_so(command):
    """mcguard stress --help says `usage: mcguard stress`, as typed."""
    code = ("import sys; sys.argv = ['/usr/local/bin/mcguard', %r, '--help']\n"
            "from mcguard import cli; sys.exit(cli.main())" % command)
    p = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.startswith("usage: mcguard %s " % command), p.stdout[:200]
