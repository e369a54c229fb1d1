"""What the serving frameworks' lifecycles (vllm_lifecycle,
sglang_lifecycle) share: the receiver's check of a request's transfers,
the wait for a failed write's engine calls over Mooncake's engine, and
ranges joined for a quiesce."""

import logging

from ..guard import MCGuardError

log = logging.getLogger("mcguard.lifecycle")

# How long a failed write over Mooncake's engine waits for its engine calls.
ENGINE_CALLS_TIMEOUT_MS = 60000


def over_mooncake(engine):
    """Whether a GuardedTransferEngine keeps Mooncake's engine as its data
    plane (the decode guard then sees no write: the prefill's guard keeps
    a quiesce, and peers name their guards)."""
    return getattr(engine, "_engine", None) is not None


def check_transfers(guard, ids, missing_hint):
    """The receiver's check of the transfers ids (sync_transfers: notices,
    digests, GPU flush): None when they all arrived as sent, else why not.
    ids None means the sender sent none: missing_hint says why that may be."""
    if ids is None:
        return "mcguard: the sender named no guarded transfers: %s" % missing_hint
    if not ids:
        return None
    try:
        guard.sync_transfers(ids)
    except MCGuardError as e:
        return "mcguard: the receiver's check of transfers %s failed: %s" % ([hex(i) for i in ids], e)
    return None


def settle_failed_write(engine, where):
    """After a failed write over Mooncake's engine, wait until no engine
    call of it still runs (a call given up at its deadline may), before
    the framework frees or rewrites the memory it wrote."""
    if not over_mooncake(engine):
        return
    if engine.wait_engine_calls(timeout_ms=ENGINE_CALLS_TIMEOUT_MS) != 0:
        log.error("mcguard: a failed write to %s still has engine calls running after %d ms", where,
                  ENGINE_CALLS_TIMEOUT_MS)


def merged(ranges):
    """ranges sorted, with overlapping and adjacent ones joined."""
    out = []
    for a, n in sorted(ranges):
        if out and a <= out[-1][0] + out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], a + n - out[-1][0]))
        else:
            out.append((a, n))
    return out
