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
and the wait for a failed write's engine calls (vllm_lifecycle). vLLM's
NixlConnector, which pulls, gets verified reads: its NIXL agent is
GuardedNixlAgent, the prefill side seals what the decode side reads, and
a read whose bytes differ is a load error (vllm_nixl; not with
MC_GUARD_VERIFY=off).

Without the plugin, the engine switch alone is one line in the connector:
    from mcguard.mooncake import GuardedTransferEngine as TransferEngine
or, keeping Mooncake's engine:
    from mcguard.mooncake import guarded_mooncake; TransferEngine = guarded_mooncake()
"""

import logging
import os

from .plugin_hooks import enabled, engine_class, on_import, provide_mooncake_engine

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


def patch_on_import(names, attr, replacement, after=None):
    """Set attr of each module in names to replacement, then call
    after(module), as it is imported (at once for those already imported).
    Returns the finder."""
    def patch(module):
        setattr(module, attr, replacement)
        if after is not None:
            after(module)
        log.info("mcguard: %s.%s is mcguard's %s", module.__name__, attr, replacement.__name__)
    return on_import(names, patch)


def _wire_lifecycle(module):
    if module.__name__ in KV_CONNECTOR_MODULES:
        from . import vllm_lifecycle
        vllm_lifecycle.wire(module)


def register():
    """vLLM's entry point: active only with MC_GUARD_VLLM=1."""
    if not enabled("MC_GUARD_VLLM", default=False):
        return None
    # The decode side's sync takes the transfers by their notices, in every
    # verification mode: guards in vLLM's processes send them unless the
    # operator chose otherwise.
    os.environ.setdefault("MC_GUARD_NOTIFY", "always")
    replacement, data_plane = engine_class("MC_GUARD_VLLM_ENGINE", "vLLM")
    if data_plane == "mcguard":
        provide_mooncake_engine(replacement)
    from . import vllm_nixl
    if vllm_nixl.read_mode() is not None:
        on_import(vllm_nixl.MODULES, vllm_nixl.wire)
    return patch_on_import(CONNECTOR_MODULES, "TransferEngine", replacement, _wire_lifecycle)
