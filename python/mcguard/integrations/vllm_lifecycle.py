"""vLLM's MooncakeConnector worker, wired to what keeps KV safe: the
receiver's check before a request's blocks are reported received, quiesce
before a failed request's blocks go back to the pool, and no failed send
reported while its engine calls still read or write.

vllm_plugin calls wire() on the connector module as it loads (MC_GUARD_VLLM=1);
the module's own file is not touched. Where vLLM's connector does one thing:

- prefill (send_kv_to_decode): each batch is one _send_blocks call, one
  guarded transfer; its id goes back to the decode side inside the
  connector's own response, as an extra field (mcguard_transfer_ids) that a
  decoder without the plugin ignores;
- decode (process_pulling_result): the requests a response reports as done
  are reported received only after the guard's sync_transfers of those ids
  (notices, digests in digest mode, GPU flush); a failure moves them to the
  response's err_reqs, vLLM's own failed-load path;
- decode (_handle_failed_recv, the one place a failed, timed-out or aborted
  pull's blocks are released): their ranges are quiesced first, so that no
  late byte of the old transfer lands in a block a new request owns; over
  Mooncake's engine, which writes without the decode guard, the quiesce
  goes over vLLM's side channel to each prefill worker, whose guard keeps
  it (mc_guard_quiesce_engine) before it answers;
- prefill (_send_blocks): over Mooncake's engine, a failed write returns to
  vLLM only once no engine call of it is still running; the decode side's
  pull (_build_pull_metadata) says where its guard listens, for the
  notices (the engine's session names the engine, not the guard).

MC_GUARD_VLLM_QUIESCE=0 leaves quiesce out (a diagnostic: the abort test's
control shows what it protects).
"""

import asyncio
import contextvars
import logging
import threading

from .lifecycle import check_transfers, merged, over_mooncake, settle_failed_write
from .plugin_hooks import enabled

log = logging.getLogger("mcguard.vllm")

# What wire() wraps or reads on vLLM's MooncakeConnectorWorker; a version
# without one of them fails at start-up instead of running unguarded.
WORKER_METHODS = ("__init__", "register_kv_caches", "send_kv_to_decode", "_build_transfer_params", "_send_blocks",
                  "_build_pull_metadata", "process_pulling_result", "_handle_failed_recv",
                  "_logical_to_kernel_block_ids", "_get_transfer_regions")
MODULE_NAMES = ("MooncakeConnectorWorker", "MooncakeXferMetadata", "MooncakeXferResponse",
                "MooncakeXferResponseStatus", "_block_ids_for_region")

# The dst_ptrs lists of one send_kv_to_decode call's batches, in the task
# that runs it (_build_transfer_params is awaited there).
_batches = contextvars.ContextVar("mcguard_vllm_batches", default=None)

# How long the decode side waits for a prefill worker to keep its quiesce
# (the prefill's guard waits up to its sync_timeout_ms for running calls).
QUIESCE_ANSWER_MS = 30000


def _vllm_version():
    try:
        import vllm
        return getattr(vllm, "__version__", "unknown")
    except ImportError:
        return "not importable"


def wire(module):
    """Wrap the connector module's worker; RuntimeError naming the vLLM
    version where its shape is not the one this wiring knows."""
    missing = [n for n in MODULE_NAMES if not hasattr(module, n)]
    cls = getattr(module, "MooncakeConnectorWorker", None)
    missing += ["MooncakeConnectorWorker.%s" % m for m in WORKER_METHODS if cls is not None and not hasattr(cls, m)]
    if missing:
        raise RuntimeError("mcguard: vLLM %s's %s lacks %s: the plugin cannot wire the guard's sync and quiesce "
                           "into this version's Mooncake connector (unset MC_GUARD_VLLM, or use a version README "
                           "lists)" % (_vllm_version(), module.__name__, ", ".join(missing)))
    if getattr(cls, "_mcguard_wired", False):
        return
    import msgspec

    class GuardedXferResponse(module.MooncakeXferResponse, omit_defaults=True):
        """The connector's response with the batch's guarded transfer ids."""
        mcguard_transfer_ids: list[int] = []

    class GuardedXferMetadata(module.MooncakeXferMetadata, omit_defaults=True):
        """The decode side's pull with where its guard listens (over
        Mooncake's engine the session is the engine's, not the guard's);
        or, with no blocks, its quiesce of ranges for the prefill's guard
        to keep (over Mooncake's engine, where the decode guard cannot)."""
        mcguard_guard_endpoint: str = ""
        mcguard_quiesce: list[list[int]] = []

    _Wiring(module, cls, GuardedXferResponse, GuardedXferMetadata, msgspec).apply()


class _Wiring:
    def __init__(self, module, cls, response_cls, pull_cls, msgspec):
        self.module, self.cls, self.msgspec = module, cls, msgspec
        self.response_cls, self.pull_cls = response_cls, pull_cls
        self.plain_decoder = msgspec.msgpack.Decoder(module.MooncakeXferResponse)
        self.encoder = msgspec.msgpack.Encoder()

    def apply(self):
        cls, orig = self.cls, {m: getattr(self.cls, m) for m in WORKER_METHODS}
        w = self

        def __init__(self, *args, **kwargs):
            orig["__init__"](self, *args, **kwargs)
            if not hasattr(self.engine, "guard"):
                raise RuntimeError("mcguard: the Mooncake connector's engine is %s, not mcguard's: the plugin's "
                                   "engine switch did not take effect" % type(self.engine).__name__)
            self._mcguard_sent, self._mcguard_mu = {}, threading.Lock()
            if not self.is_kv_producer:
                self._xfer_resp_decoder = w.msgspec.msgpack.Decoder(w.response_cls)
            if not self.is_kv_consumer:
                self._xfer_meta_decoder = w.msgspec.msgpack.Decoder(w.pull_cls)

        def register_kv_caches(self, kv_caches):
            orig["register_kv_caches"](self, kv_caches)
            if not self.is_kv_producer:
                try:  # the layout this wiring quiesces by, checked now rather than at the first abort
                    block_ranges(self, w.module, [[0] for _ in self.kv_cache_config.transfer_groups])
                except Exception as e:
                    raise RuntimeError("mcguard: vLLM %s's KV layout here is not one the plugin can quiesce by "
                                       "block: %s" % (_vllm_version(), e)) from e

        async def send_kv_to_decode(self, identity, sock, meta):
            if getattr(meta, "mcguard_quiesce", None):
                return await w.keep_quiesce(self, identity, sock, meta)
            endpoint = getattr(meta, "mcguard_guard_endpoint", "")
            if endpoint and over_mooncake(self.engine):
                self.engine.set_peer_guard("%s:%d" % (meta.remote_hostname, meta.remote_port), endpoint)
            batches = []
            token = _batches.set(batches)
            try:
                return await orig["send_kv_to_decode"](self, identity, _Answers(sock, self, w), meta)
            finally:
                _batches.reset(token)
                with self._mcguard_mu:  # ids of batches no response carried (an exception on the way)
                    for d in batches:
                        self._mcguard_sent.pop(id(d), None)

        async def _build_transfer_params(self, *args, **kwargs):
            out = await orig["_build_transfer_params"](self, *args, **kwargs)
            batches = _batches.get()
            if batches is not None and out[1]:
                batches.append(out[1])
            return out

        def _send_blocks(self, remote_session, src_ptrs, dst_ptrs, lengths):
            ret = orig["_send_blocks"](self, remote_session, src_ptrs, dst_ptrs, lengths)
            if ret == 0:
                with self._mcguard_mu:
                    self._mcguard_sent[id(dst_ptrs)] = self.engine.last_transfer_id
            else:  # vLLM frees or rewrites the blocks once told
                settle_failed_write(self.engine, remote_session)
            return ret

        def _build_pull_metadata(self, pull_metas, **kwargs):
            meta = orig["_build_pull_metadata"](self, pull_metas, **kwargs)
            fields = {f: getattr(meta, f) for f in meta.__struct_fields__}
            return w.pull_cls(**fields, mcguard_guard_endpoint=self.engine.get_guard_endpoint())

        def process_pulling_result(self, response, pull_metas):
            return orig["process_pulling_result"](self, w.checked(self, response, pull_metas), pull_metas)

        def _handle_failed_recv(self, pull_metas, req_ids, reason):
            if enabled("MC_GUARD_VLLM_QUIESCE"):
                w.quiesce(self, [pull_metas[r] for r in req_ids if r in pull_metas])
            return orig["_handle_failed_recv"](self, pull_metas, req_ids, reason)

        for name, fn in (("__init__", __init__), ("register_kv_caches", register_kv_caches),
                         ("send_kv_to_decode", send_kv_to_decode), ("_build_transfer_params", _build_transfer_params),
                         ("_send_blocks", _send_blocks), ("_build_pull_metadata", _build_pull_metadata),
                         ("process_pulling_result", process_pulling_result),
                         ("_handle_failed_recv", _handle_failed_recv)):
            fn.__wrapped__ = orig[name]
            fn.__qualname__ = "%s.%s" % (cls.__name__, name)
            setattr(cls, name, fn)
        cls._mcguard_wired = True
        log.info("mcguard: vLLM %s's MooncakeConnectorWorker: sync before received, quiesce before release%s",
                 _vllm_version(), "" if enabled("MC_GUARD_VLLM_QUIESCE") else " (quiesce OFF)")

    def answer(self, worker, batches, payload):
        """The response payload with the ids of the batches sent since the
        last response."""
        with worker._mcguard_mu:
            ids = [worker._mcguard_sent.pop(id(d)) for d in batches if id(d) in worker._mcguard_sent]
        batches.clear()
        ids = [i for i in ids if i is not None]
        if not ids:
            return payload
        r = self.plain_decoder.decode(payload)
        fields = {f: getattr(r, f) for f in r.__struct_fields__}
        return self.encoder.encode(self.response_cls(**fields, mcguard_transfer_ids=ids))

    def checked(self, worker, response, pull_metas):
        """response, with the requests it reports done whose transfers the
        guard did not confirm moved to its err_reqs."""
        done = [r for r in (response.ok_reqs or []) if r in pull_metas and any(pull_metas[r].local_block_ids)]
        if not done:
            return response
        why = check_transfers(worker.engine.guard, list(getattr(response, "mcguard_transfer_ids", None) or []) or None,
                              "is MC_GUARD_VLLM=1 set on the prefill side?")
        if why is None:
            return response
        log.error("%s; requests %s are reported as failed loads", why, done)
        keep = [r for r in response.ok_reqs if r not in done]
        return self.msgspec.structs.replace(response, ok_reqs=keep or None,
                                            err_reqs=list(response.err_reqs or []) + done, err_msg=why)

    def quiesce(self, worker, metas):
        """Quiesce the blocks of failed pulls before vLLM releases them: at
        the decode guard, or over Mooncake's engine (which writes without
        it) at each prefill worker the pulls went to."""
        metas = [m for m in metas if any(m.local_block_ids)]
        if not metas:
            return
        try:
            ranges = []
            for m in metas:
                ranges.extend(block_ranges(worker, self.module, m.local_block_ids))
            ranges = merged(ranges)
            if not over_mooncake(worker.engine):
                worker.engine.guard.quiesce([a for a, _ in ranges], [n for _, n in ranges])
            else:
                for addr in sorted({a for m in metas for a in prefill_workers(worker, m.remote_engine_id)}):
                    self.quiesce_at_prefill(worker, addr, ranges)
        except Exception as e:  # vLLM releases the blocks regardless: say so loudly
            log.error("mcguard: quiesce of the blocks of %d failed pulls failed, so a late write of theirs can "
                      "still land in a block vLLM gives to another request: %s", len(metas), e)

    def quiesce_at_prefill(self, worker, addr, ranges):
        """Send the quiesce to the prefill worker at addr over vLLM's side
        channel and wait for its answer: once it came, no engine call of a
        write begun before can land in ranges."""
        import zmq  # vLLM's dependency, not mcguard's
        meta = self.pull_cls(remote_hostname=worker.hostname, remote_port=worker.rpc_port,
                             remote_tp_size=worker.tp_size, remote_tp_rank=worker.tp_rank, req_blocks={},
                             kv_caches_base_addr=[], block_lens=[], kv_block_lens=[],
                             mcguard_quiesce=[[a, n] for a, n in ranges])
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, QUIESCE_ANSWER_MS)
        try:
            sock.connect(addr)
            sock.send(self.encoder.encode(meta))
            try:
                answer = self.plain_decoder.decode(sock.recv())
            except zmq.Again:
                raise TimeoutError("no answer from the prefill worker at %s in %d ms" % (addr, QUIESCE_ANSWER_MS))
        finally:
            sock.close()
        if answer.status != self.module.MooncakeXferResponseStatus.FINISH:
            raise RuntimeError("the prefill worker at %s: %s" % (addr, answer.err_msg))

    async def keep_quiesce(self, worker, identity, sock, meta):
        """Prefill side: a decode worker's quiesce, kept by this guard over
        Mooncake's engine; the answer says whether it holds."""
        status, why = self.module.MooncakeXferResponseStatus, None
        session = "%s:%d" % (meta.remote_hostname, meta.remote_port)
        addrs, lens = [a for a, _ in meta.mcguard_quiesce], [n for _, n in meta.mcguard_quiesce]
        try:
            await asyncio.get_running_loop().run_in_executor(
                None, lambda: worker.engine.guard.quiesce_engine(session, addrs, lens))
        except Exception as e:
            why = "mcguard: quiesce of %d ranges at %s: %s" % (len(addrs), session, e)
            log.error("%s", why)
        answer = self.module.MooncakeXferResponse(status=status.ERROR if why else status.FINISH, err_msg=why)
        await sock.send_multipart((identity, self.encoder.encode(answer)))


class _Answers:
    """The side channel's socket for one send_kv_to_decode call: each
    response it sends carries the ids of the batches sent before it."""

    def __init__(self, sock, worker, wiring):
        self._sock, self._worker, self._wiring = sock, worker, wiring

    def __getattr__(self, name):
        return getattr(self._sock, name)

    async def send_multipart(self, frames, *args, **kwargs):
        batches = _batches.get()
        if batches:
            identity, payload = frames
            frames = (identity, self._wiring.answer(self._worker, batches, payload))
        return await self._sock.send_multipart(frames, *args, **kwargs)


def prefill_workers(worker, engine_id):
    """The side-channel addresses of the prefill workers of engine_id this
    decode worker pulls from (as receive_kv picks them), or all of them."""
    agents = worker._remote_agents.get(engine_id, {})
    return [addr for by_pp in agents.values() for addr in by_pp.values()]


def block_ranges(worker, module, block_ids):
    """[(addr, len)] of the decode side's blocks block_ids (per KV group, as
    vLLM's PullReqMeta holds them) in every registered region: whole blocks,
    each within its registered storage."""
    kernel = worker._logical_to_kernel_block_ids(block_ids)
    regions = worker._get_transfer_regions(
        worker.kv_caches_base_addr, worker.block_len_per_layer, worker.kv_block_len_per_layer,
        worker.registered_layer_names, worker.registered_layer_indices, worker.registered_group_indices,
        worker.region_shared_groups, worker.region_row_offsets)
    storages = sorted(zip(worker.seen_base_addresses, worker._kv_data_lens))
    out = []
    for region in regions:
        for b in module._block_ids_for_region(kernel, region.group_index, region.shared_group_ids):
            start = region.base_addr + b * region.block_len
            base, size = next(((s, n) for s, n in storages if s <= start < s + n), (None, None))
            if base is None:
                raise ValueError("block %d of %s at %#x is outside the registered KV storage"
                                 % (b, region.layer_name, start))
            out.append((start, min(region.block_len, base + size - start)))
    return out
