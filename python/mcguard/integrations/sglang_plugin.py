"""SGLang without patching SGLang: a general plugin (entry point group
sglang.srt.plugins, which SGLang loads at the start of every scheduler
process) that, when MC_GUARD_SGLANG=1, makes SGLang's Mooncake transfer
engine wrapper construct mcguard's GuardedTransferEngine, and wires the
guard into its PD lifecycle (sglang_lifecycle).

SGLang's MooncakeTransferEngine does `from mooncake.engine import
TransferEngine` inside its constructor; the plugin wraps that constructor
so the name it finds there is mcguard's engine (only there: other users of
Mooncake in the process keep theirs). Where Mooncake is not installed, the
plugin provides `mooncake.engine` for that import.

MC_GUARD_SGLANG_ENGINE=mooncake keeps Mooncake's engine as the data plane
(each engine a GuardedTransferEngine over a new Mooncake TransferEngine);
unset or "mcguard", mcguard's own data plane moves the bytes.

SGLang logs and swallows an exception a plugin raises; the wiring raises
when SGLang imports the modules it wires instead, which fails the
scheduler's start, naming SGLang's version.
"""

import logging
import os

from .plugin_hooks import enabled, engine_class, on_import, provide_mooncake_engine

log = logging.getLogger("mcguard.sglang")

ENGINE_MODULE = "sglang.srt.distributed.device_communicators.mooncake_transfer_engine"
CONN_MODULE = "sglang.srt.disaggregation.mooncake.conn"
DECODE_MODULE = "sglang.srt.disaggregation.decode"


def register():
    """SGLang's entry point: active only with MC_GUARD_SGLANG=1."""
    if not enabled("MC_GUARD_SGLANG", default=False):
        return None
    from . import sglang_lifecycle
    # The decode side's check takes the transfers by their notices, in
    # every verification mode.
    os.environ.setdefault("MC_GUARD_NOTIFY", "always")
    replacement, data_plane = engine_class("MC_GUARD_SGLANG_ENGINE", "SGLang")
    if data_plane == "mcguard":
        provide_mooncake_engine(replacement)
    wiring = {ENGINE_MODULE: lambda m: sglang_lifecycle.wire_engine(m, replacement),
              CONN_MODULE: sglang_lifecycle.wire_manager,
              DECODE_MODULE: sglang_lifecycle.wire_decode}
    log.info("mcguard: SGLang's Mooncake engine is mcguard's (%s data plane)", data_plane)
    return on_import(tuple(wiring), lambda m: wiring[m.__name__](m))
