"""vLLM without patching vLLM: a general plugin (entry point group
vllm.general_plugins, which vLLM loads in every process it starts) that,
when MC_GUARD_VLLM=1, makes vLLM's Mooncake connector construct
mcguard's GuardedTransferEngine instead of Mooncake's TransferEngine.

The connector does `from mooncake.engine import TransferEngine` when its
module is imported, and later `TransferEngine()`. The plugin watches for
that module (both places vLLM has kept it) and, as it finishes loading,
replaces its TransferEngine name. Where Mooncake is not installed, it also
provides `mooncake.engine` with GuardedTransferEngine as TransferEngine,
so the connector's import succeeds.

With MC_GUARD_VLLM_ENGINE=mooncake the data plane stays Mooncake's: each
TransferEngine() the connector makes is a GuardedTransferEngine over a new
Mooncake TransferEngine (Mooncake installed, or the plugin fails loudly);
unset or "mcguard", mcguard's own data plane moves the bytes.

On the KV connector's worker it also wires in the receiver's sync, quiesce
and the wait for a failed write's engine calls (vllm_lifecycle).

Without the plugin, the engine switch alone is one line in the connector:
    from mcguard.mooncake import GuardedTransferEngine as TransferEngine
or, keeping Mooncake's engine:
    from mcguard.mooncake import guarded_mooncake; TransferEngine = guarded_mooncake()
"""

import importlib.abc
import importlib.util
import logging
import os
import sys
import types

log = logging.getLogger("mcguard.vllm")

# The KV connector modules (its path before and since vLLM moved it into
# v1/mooncake/): their worker is wired to the guard's lifecycle too.
KV_CONNECTOR_MODULES = (
    "vllm.distributed.kv_transfer.kv_connector.v1.mooncake_connector",
    "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector",
)
# The modules that do `from mooncake.engine import TransferEngine`: the KV
# connector and, in vLLM 0.34, the encoder-cache connector's transfer module.
CONNECTOR_MODULES = KV_CONNECTOR_MODULES + (
    "vllm.distributed.ec_transfer.ec_connector.mooncake.transfer",
)


class _Patcher(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the named modules through the other finders, runs them, then
    sets attr on each to replacement and calls after(module)."""

    def __init__(self, names, attr, replacement, after=None):
        self.names, self.attr, self.replacement, self.after = set(names), attr, replacement, after
        self.patched = []

    def find_spec(self, name, path, target=None):
        if name not in self.names:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = finder.find_spec(name, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                self._inner = spec.loader
                spec.loader = self
                return spec
        return None

    def create_module(self, spec):
        return self._inner.create_module(spec) if hasattr(self._inner, "create_module") else None

    def exec_module(self, module):
        self._inner.exec_module(module)
        self._patch(module)

    def _patch(self, module):
        setattr(module, self.attr, self.replacement)
        if self.after is not None:
            self.after(module)
        self.patched.append(module.__name__)
        log.info("mcguard: %s.%s is mcguard's %s", module.__name__, self.attr, self.replacement.__name__)


def patch_on_import(names, attr, replacement, after=None):
    """Set attr of each module in names to replacement, then call
    after(module), as it is imported (at once for those already imported).
    Returns the finder."""
    patcher = _Patcher(names, attr, replacement, after)
    for name in names:
        if name in sys.modules:
            patcher._patch(sys.modules[name])
    sys.meta_path.insert(0, patcher)
    return patcher


def _provide_mooncake_engine(engine_cls):
    """A mooncake.engine module with engine_cls as TransferEngine, where
    Mooncake itself is not installed."""
    try:
        if importlib.util.find_spec("mooncake.engine") is not None:
            return False
    except ImportError:
        pass
    pkg = sys.modules.setdefault("mooncake", types.ModuleType("mooncake"))
    pkg.__path__ = getattr(pkg, "__path__", [])
    from . import mooncake as ours
    engine = types.ModuleType("mooncake.engine")
    engine.TransferEngine = engine_cls
    engine.TransferOpcode, engine.TransferNotify = ours.TransferOpcode, ours.TransferNotify
    engine.Read, engine.Write = ours.TransferOpcode.Read, ours.TransferOpcode.Write
    sys.modules["mooncake.engine"] = engine
    pkg.engine = engine
    return True


def _wire_lifecycle(module):
    if module.__name__ in KV_CONNECTOR_MODULES:
        from . import vllm_lifecycle
        vllm_lifecycle.wire(module)


def register():
    """vLLM's entry point: active only with MC_GUARD_VLLM=1."""
    if os.environ.get("MC_GUARD_VLLM", "").strip().lower() not in ("1", "true", "yes", "on"):
        return None
    from .mooncake import GuardedTransferEngine, guarded_mooncake
    # The decode side's sync takes the transfers by their notices, in every
    # verification mode: guards in vLLM's processes send them unless the
    # operator chose otherwise.
    os.environ.setdefault("MC_GUARD_NOTIFY", "always")
    data_plane = os.environ.get("MC_GUARD_VLLM_ENGINE", "mcguard").strip().lower() or "mcguard"
    if data_plane == "mooncake":
        try:
            replacement = guarded_mooncake()
        except ImportError as e:
            raise RuntimeError("mcguard: MC_GUARD_VLLM_ENGINE=mooncake keeps Mooncake's engine as the data plane, "
                               "and Mooncake is not importable (%s): install mooncake-transfer-engine, or unset "
                               "MC_GUARD_VLLM_ENGINE to use mcguard's own" % e) from None
        return patch_on_import(CONNECTOR_MODULES, "TransferEngine", replacement, _wire_lifecycle)
    if data_plane != "mcguard":
        raise RuntimeError("mcguard: MC_GUARD_VLLM_ENGINE=%r: use mooncake (keep Mooncake's engine) or mcguard"
                           % data_plane)
    if _provide_mooncake_engine(GuardedTransferEngine):
        log.info("mcguard: Mooncake is not installed: mooncake.engine.TransferEngine is mcguard's")
    return patch_on_import(CONNECTOR_MODULES, "TransferEngine", GuardedTransferEngine, _wire_lifecycle)
