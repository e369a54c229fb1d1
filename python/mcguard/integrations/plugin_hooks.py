"""What mcguard's serving-framework plugins (vLLM, SGLang) share: switches
read from the environment, the engine class a plugin puts in place of
Mooncake's, and wrapping a framework's modules as they are imported, so
that none of its files is patched."""

import importlib.abc
import importlib.util
import logging
import os
import sys
import types

log = logging.getLogger("mcguard.plugin")


def enabled(name, default=True):
    """The on/off switch in environment variable name: 0, false, no and off
    are off; unset or empty is default."""
    v = os.environ.get(name, "").strip().lower()
    return default if not v else v not in ("0", "false", "no", "off")


def engine_class(variable, framework):
    """The TransferEngine class a plugin installs, by the data plane that
    environment variable names: "mcguard" (or unset), mcguard's own; or
    "mooncake", each engine a GuardedTransferEngine over a new Mooncake
    TransferEngine (RuntimeError where Mooncake is not importable). Returns
    (class, data plane)."""
    from .mooncake import GuardedTransferEngine, guarded_mooncake
    data_plane = os.environ.get(variable, "mcguard").strip().lower() or "mcguard"
    if data_plane == "mooncake":
        try:
            return guarded_mooncake(), data_plane
        except ImportError as e:
            raise RuntimeError("mcguard: %s=mooncake keeps Mooncake's engine as %s's data plane, and Mooncake is "
                               "not importable (%s): install mooncake-transfer-engine, or unset %s to use mcguard's "
                               "own" % (variable, framework, e, variable)) from None
    if data_plane != "mcguard":
        raise RuntimeError("mcguard: %s=%r: use mooncake (keep Mooncake's engine) or mcguard" % (variable, data_plane))
    return GuardedTransferEngine, data_plane


def provide_mooncake_engine(engine_cls):
    """A mooncake.engine module with engine_cls as TransferEngine, where
    Mooncake itself is not installed. Returns whether it provided one."""
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
    log.info("mcguard: Mooncake is not installed: mooncake.engine.TransferEngine is mcguard's")
    return True


class _Patcher(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the named modules through the other finders, runs them, then
    calls after(module) on each."""

    def __init__(self, names, after):
        self.names, self.after = set(names), after
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
        self.after(module)
        self.patched.append(module.__name__)


def on_import(names, after):
    """Call after(module) on each module in names as it is imported (at once
    for those already imported); an exception of after's fails the import.
    Returns the finder."""
    patcher = _Patcher(names, after)
    for name in names:
        if name in sys.modules:
            patcher._patch(sys.modules[name])
    sys.meta_path.insert(0, patcher)
    return patcher


def wrap_methods(cls, wrappers):
    """Set each of cls's methods named in wrappers (name: function of the
    original) to what the function returns, marked as a wrapper of it."""
    for name, make in wrappers.items():
        orig = getattr(cls, name)
        fn = make(orig)
        fn.__wrapped__ = orig
        fn.__qualname__ = "%s.%s" % (cls.__name__, name)
        setattr(cls, name, fn)
