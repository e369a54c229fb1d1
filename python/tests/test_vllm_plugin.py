"""The vLLM general plugin: with MC_GUARD_VLLM=1 the connector module's
TransferEngine becomes GuardedTransferEngine as the module is imported.
Tested on a stand-in module of the connector's shape here, and on vLLM's
own module where vllm is importable."""

import importlib
import subprocess
import sys
import textwrap

import pytest

PLUGIN_CHECK = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {tmp!r})
    os.environ["MC_GUARD_VLLM"] = {flag!r}
    from mcguard.integrations import vllm_plugin
    from mcguard.mooncake import GuardedTransferEngine
    vllm_plugin.CONNECTOR_MODULES = vllm_plugin.CONNECTOR_MODULES + ("fake_connector",)
    vllm_plugin.register()
    import fake_connector
    print(fake_connector.TransferEngine is GuardedTransferEngine)
    engine = fake_connector.make_engine()
    print(type(engine).__name__, engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", ""))
    engine.close() if hasattr(engine, "close") else None
""")

# What vLLM's connector does: the import at module level, the call later.
FAKE_CONNECTOR = textwrap.dedent("""
    from mooncake.engine import TransferEngine

    def make_engine():
        return TransferEngine()
""")


def run_check(tmp_path, flag):
    (tmp_path / "fake_connector.py").write_text(FAKE_CONNECTOR)
    p = subprocess.run([sys.executable, "-c", PLUGIN_CHECK.format(tmp=str(tmp_path), flag=flag)],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=60)
    return p


def mooncake_installed():
    try:
        return importlib.util.find_spec("mooncake.engine") is not None
    except ImportError:
        return False


def test_the_plugin_switches_the_connectors_engine(tmp_path):
    p = run_check(tmp_path, "1")
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == ["True", "GuardedTransferEngine 0"]


def test_without_the_flag_the_plugin_does_nothing(tmp_path):
    p = run_check(tmp_path, "0")
    if mooncake_installed():
        assert p.returncode == 0 and p.stdout.splitlines()[0] == "False"
    else:
        assert p.returncode != 0 and "No module named 'mooncake'" in p.stderr


def test_on_vllms_own_connector_module():
    try:
        import vllm  # noqa: F401
    except ImportError:
        pytest.skip("vllm is not installed in this interpreter: make test-vllm runs this in its environment")
    code = textwrap.dedent("""
        import os; os.environ["MC_GUARD_VLLM"] = "1"
        from mcguard.integrations import vllm_plugin
        from mcguard.mooncake import GuardedTransferEngine
        vllm_plugin.register()
        import importlib
        for name in vllm_plugin.CONNECTOR_MODULES:
            try:
                m = importlib.import_module(name)
            except ModuleNotFoundError:
                continue
            print(name, m.TransferEngine is GuardedTransferEngine)
    """)
    p = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines and all(line.endswith("True") for line in lines), lines


OVER_MOONCAKE_CHECK = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {tmp!r})
    os.environ["MC_GUARD_VLLM"], os.environ["MC_GUARD_VLLM_ENGINE"] = "1", "mooncake"
    from mcguard.integrations import vllm_plugin
    vllm_plugin.CONNECTOR_MODULES = vllm_plugin.CONNECTOR_MODULES + ("fake_connector",)
    vllm_plugin.register()
    import fake_connector, mooncake.engine
    engine = fake_connector.make_engine()
    print(type(engine).__name__, type(engine._engine) is mooncake.engine.TransferEngine,
          engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", ""), engine.guard.stats()["transport"],
          engine.get_rpc_port() == engine._engine.get_rpc_port())
    engine.close()
""")


def test_the_plugin_can_keep_mooncakes_engine_as_the_data_plane(tmp_path):
    from test_mooncake_engine import run_with_mooncake
    (tmp_path / "fake_connector.py").write_text(FAKE_CONNECTOR)
    out = run_with_mooncake("-c", OVER_MOONCAKE_CHECK.format(tmp=str(tmp_path)), timeout=120)
    assert out.stdout.split() == ["GuardedMooncakeTransferEngine", "True", "0", "engine", "True"]


def test_keeping_mooncakes_engine_without_mooncake_fails_loudly(tmp_path, monkeypatch):
    if mooncake_installed():
        pytest.skip("Mooncake is installed in this interpreter")
    code = ("import os; os.environ['MC_GUARD_VLLM'], os.environ['MC_GUARD_VLLM_ENGINE'] = '1', 'mooncake'\n"
            "from mcguard.integrations import vllm_plugin; vllm_plugin.register()")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "Mooncake is not importable" in p.stderr


def test_a_connector_of_another_shape_fails_at_start_naming_the_version():
    """The lifecycle wiring refuses a connector module it does not know
    rather than leave sync and quiesce off."""
    import types
    from mcguard.integrations import vllm_lifecycle
    module = types.ModuleType("vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector")

    class MooncakeConnectorWorker:  # an older shape: no _handle_failed_recv, among others
        def __init__(self):
            pass

    module.MooncakeConnectorWorker = MooncakeConnectorWorker
    with pytest.raises(RuntimeError) as e:
        vllm_lifecycle.wire(module)
    msg = str(e.value)
    assert "vLLM" in msg and "lacks" in msg and "_handle_failed_recv" in msg and "MooncakeXferResponse" in msg, msg
    assert not hasattr(MooncakeConnectorWorker, "_mcguard_wired")


def test_quiesced_block_ranges_are_joined():
    from mcguard.integrations.vllm_lifecycle import merged
    assert merged([(300, 100), (0, 100), (100, 50), (120, 10), (500, 1)]) == [(0, 150), (300, 100), (500, 1)]


def test_on_vllms_own_nixl_connector_modules():
    """With MC_GUARD_VLLM=1 the NixlConnector's agent is GuardedNixlAgent
    and its pull worker and scheduler are wired; with MC_GUARD_VERIFY=off
    they are left as they are."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        pytest.skip("vllm is not installed in this interpreter: make test-vllm runs this in its environment")
    code = textwrap.dedent("""
        import os, sys; os.environ["MC_GUARD_VLLM"] = "1"; os.environ["MC_GUARD_VERIFY"] = sys.argv[1]
        from mcguard.integrations import vllm_plugin
        vllm_plugin.register()
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker, pull_worker, pull_scheduler
        print(getattr(base_worker.NixlWrapper, "_mcguard", False),
              getattr(pull_worker.NixlPullConnectorWorker, "_mcguard_wired", False),
              getattr(pull_scheduler.NixlPullConnectorScheduler, "_mcguard_wired", False))
    """)
    for verify, want in (("digest", "True True True"), ("off", "False False False")):
        p = subprocess.run([sys.executable, "-c", code, verify], capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr
        assert p.stdout.splitlines()[-1] == want, (verify, p.stdout)


def test_a_nixl_connector_of_another_shape_fails_at_start_naming_the_version():
    import types
    from mcguard.integrations import vllm_nixl
    module = types.ModuleType(vllm_nixl.PULL_WORKER)

    class NixlPullConnectorWorker:  # an older shape: its READs made elsewhere
        def start_load_kv(self, metadata):
            pass

    module.NixlPullConnectorWorker = NixlPullConnectorWorker
    with pytest.raises(RuntimeError) as e:
        vllm_nixl.wire(module)
    msg = str(e.value)
    assert "vLLM" in msg and "lacks" in msg and "_read_blocks" in msg and "get_transfer_results" in msg, msg
    assert not hasattr(NixlPullConnectorWorker, "_mcguard_wired")


@pytest.mark.parametrize("verify,mode", [("tail", "tail"), ("sample", "tail"), ("digest", "digest"),
                                         ("full", "digest"), ("", "tail"), ("off", None)])
def test_a_reads_check_follows_mc_guard_verify(monkeypatch, verify, mode):
    from mcguard.integrations import vllm_nixl
    monkeypatch.setenv("MC_GUARD_VERIFY", verify)
    assert vllm_nixl.read_mode() == mode
