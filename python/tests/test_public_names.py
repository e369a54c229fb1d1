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
    "mcguard.abi": ["STATUS_NAMES", "VERIFY_MODES", "TransferOpts", "SyncOpts", "TransportOps", "MC_OK"],
    "mcguard.engine": ["Engine", "MooncakeEngine", "EngineError"],
    "mcguard.mooncake": ["GuardedTransferEngine", "TransferOpcode", "TransferNotify"],
    "mcguard.metrics": ["Collector"],
    "mcguard.nixl": ["GuardedNixlAgent", "ranges_of"],
    "mcguard.stress": ["main"],
    "mcguard.integrations.mooncake": ["GuardedTransferEngine"],
    "mcguard.integrations.metrics": ["Collector"],
    "mcguard.integrations.vllm_plugin": ["register"],
    "mcguard.integrations.sglang_plugin": ["register"],
    "mcguard.tools.stress": ["main"],
    "mcguard.tools.cli": ["main"],
}

# The names applications import from their old places are the very modules
# that moved (a test's monkeypatch, an isinstance check, see one module).
ALIASES = {"mcguard.mooncake": "mcguard.integrations.mooncake", "mcguard.metrics": "mcguard.integrations.metrics",
           "mcguard.stress": "mcguard.tools.stress", "mcguard.nixl": "mcguard.integrations.nixl"}


@pytest.mark.parametrize("module", sorted(NAMES))
def test_the_names_users_import_stay(module):
    if module.endswith(".metrics"):
        pytest.importorskip("prometheus_client")
    m = importlib.import_module(module)
    missing = [n for n in NAMES[module] if not hasattr(m, n)]
    assert not missing, "%s lost %s" % (module, missing)


@pytest.mark.parametrize("old", sorted(ALIASES))
def test_an_old_name_is_the_moved_module_itself(old):
    if old.endswith(".metrics"):
        pytest.importorskip("prometheus_client")
    assert importlib.import_module(old) is importlib.import_module(ALIASES[old])


def test_entry_points_name_what_exists():
    """The entry points' names (mcguard, in each group) are what users and
    frameworks select by; their targets exist."""
    text = open(os.path.join(ROOT, "pyproject.toml")).read()
    for target in ("mcguard.tools.cli:main", "mcguard.integrations.vllm_plugin:register",
                   "mcguard.integrations.sglang_plugin:register"):
        assert target in text
        module, name = target.split(":")
        assert callable(getattr(importlib.import_module(module), name))


@pytest.mark.parametrize("module", ["mcguard.stress", "mcguard.tools.stress", "mcguard.tools.bench",
                                    "mcguard.tools.demo", "mcguard.tools.peerbench", "mcguard.tools.devicecheck",
                                    "mcguard.tools.cli"])
def test_modules_run_with_dash_m_answer_help(module):
    p = subprocess.run([sys.executable, "-m", module, "--help"], env=ENV, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "usage" in p.stdout.lower() or "mcguard" in p.stdout


def test_every_module_imports_alone():
    """An import circle shows as a module that fails to import first."""
    pkg = os.path.join(ROOT, "python", "mcguard")
    modules = []
    for sub in ("", "integrations", "tools"):
        prefix = "mcguard." + (sub + "." if sub else "")
        modules += sorted(prefix + f[:-3] for f in os.listdir(os.path.join(pkg, sub))
                          if f.endswith(".py") and f != "__init__.py")
    for name in modules:
        if name.endswith(".metrics"):
            try:
                import prometheus_client  # noqa: F401
            except ImportError:
                continue
        p = subprocess.run([sys.executable, "-c", "import %s" % name], env=ENV, capture_output=True,
                           text=True, timeout=60)
        assert p.returncode == 0, "%s: %s" % (name, p.stderr[-2000:])


def test_the_library_does_not_import_its_integrations_or_tools():
    """The binding (guard, engine, callbacks, the ABI) stands alone; the
    integrations and tools stand on it, never the other way."""
    pkg = os.path.join(ROOT, "python", "mcguard")
    for f in ("guard.py", "engine.py", "callbacks.py", "abi.py", "_lib.py", "__init__.py"):
        text = open(os.path.join(pkg, f)).read()
        assert ".integrations" not in text and ".tools" not in text, f


@pytest.mark.parametrize("command", ["stress", "bench", "demo"])
def test_a_subcommand_of_the_mcguard_command_names_itself_so(command):
    """mcguard stress --help says `usage: mcguard stress`, as typed."""
    code = ("import sys; sys.argv = ['/usr/local/bin/mcguard', %r, '--help']\n"
            "from mcguard.tools import cli; sys.exit(cli.main())" % command)
    p = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.startswith("usage: mcguard %s " % command), p.stdout[:200]
