"""vLLM's NixlConnector (its pull mode: the decode side READs the prefill
side's blocks) with verified reads: a request's blocks are reported
received only when the bytes that landed are the bytes the prefill side
sealed; otherwise vLLM's own load-error path takes them.

vllm_plugin calls wire() on the connector's modules as they load
(MC_GUARD_VLLM=1, MC_GUARD_VERIFY not off); no file of vLLM's is touched.
Where the connector does one thing:

- both sides: its NIXL agent (base_worker.NixlWrapper, NIXL's nixl_agent)
  is a GuardedNixlAgent over NIXL's own: NIXL moves the bytes; the agent's
  metadata, which vLLM's handshake carries, names the prefill worker's
  guard and where it listens;
- prefill, scheduler (request_finished): the blocks of a finished request
  that the decode side will read go to the worker in the connector
  metadata (build_connector_meta), which otherwise carries only the
  request's id;
- prefill, worker (start_load_kv): as it learns the request finished, the
  worker seals those blocks, as vLLM's own descriptor list for them names
  them, and publishes the seal under the request's id (the
  remote_request_id the decode side gets in kv_transfer_params); a seal is
  withdrawn SEAL_GRACE_S after vLLM handed the blocks back;
- decode, worker (_read_blocks): each READ of a request names that seal;
  the agent fetches it from the prefill worker's guard while NIXL reads,
  and check_xfer_state says "DONE" only once the landed bytes match it,
  "ERR" otherwise: vLLM then reports the request's blocks as load errors.

The seal cannot travel inside kv_transfer_params: vLLM's scheduler makes
them when the request finishes, before the worker that holds the bytes is
told about it. The checks are MC_GUARD_VERIFY's: tail and sample check the
last 16 bytes of every block, digest and full every byte (docs/READS.md).
"""

import collections
import inspect
import logging
import os
import time

from .plugin_hooks import wrap_methods

log = logging.getLogger("mcguard.vllm")

BASE_WORKER = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"
PULL_WORKER = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker"
PULL_SCHEDULER = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler"
MODULES = (BASE_WORKER, PULL_WORKER, PULL_SCHEDULER)

# What wire() wraps or reads on vLLM's pull worker; a version without one
# of them fails at start-up instead of running unchecked.
WORKER_NEEDS = ("__init__", "start_load_kv", "get_transfer_results", "_read_blocks", "_compute_desc_ids",
                "_logical_to_kernel_block_ids")
SCHEDULER_NEEDS = ("request_finished", "build_connector_meta")

# How long a published seal outlives its blocks' lease: a decode worker
# that posted its READ just before fetches it after the prefill side was
# told the READ finished.
SEAL_GRACE_S = 30.0
# The most withdrawals waiting for their time (past it, the oldest go now).
MAX_PENDING_WITHDRAWALS = 65536


def read_mode():
    """The check a READ gets under MC_GUARD_VERIFY: "tail" (tail, sample),
    "digest" (digest, full), or None (off: the connector is left as it is)."""
    v = os.environ.get("MC_GUARD_VERIFY", "tail").strip().lower() or "tail"
    if v in ("off", "0", "false", "no"):
        return None
    return "digest" if v in ("digest", "full") else "tail"


def _vllm_version():
    try:
        import vllm
        return getattr(vllm, "__version__", "unknown")
    except ImportError:
        return "not importable"


def _missing(module, cls_name, needs):
    cls = getattr(module, cls_name, None)
    if cls is None:
        return [cls_name]
    return ["%s.%s" % (cls_name, m) for m in needs if not hasattr(cls, m)]


def _refuse(module, missing):
    raise RuntimeError("mcguard: vLLM %s's %s lacks %s: the plugin cannot check the NixlConnector's reads in this "
                       "version (unset MC_GUARD_VLLM, or use a version README lists)"
                       % (_vllm_version(), module.__name__, ", ".join(missing)))


def wire(module):
    """Wire one of MODULES; RuntimeError naming the vLLM version where its
    shape is not the one this wiring knows."""
    name = module.__name__
    if name == BASE_WORKER:
        _wire_agent(module)
    elif name == PULL_SCHEDULER:
        missing = _missing(module, "NixlPullConnectorScheduler", SCHEDULER_NEEDS)
        if missing:
            _refuse(module, missing)
        _wire_scheduler(module.NixlPullConnectorScheduler)
    elif name == PULL_WORKER:
        missing = _missing(module, "NixlPullConnectorWorker", WORKER_NEEDS)
        if missing:
            _refuse(module, missing)
        _wire_worker(module.NixlPullConnectorWorker)


def _wire_agent(module):
    """base_worker's NixlWrapper: GuardedNixlAgent over NIXL's agent."""
    if not hasattr(module, "NixlWrapper"):
        _refuse(module, ["NixlWrapper"])
    nixl_agent = module.NixlWrapper
    if nixl_agent is None or getattr(nixl_agent, "_mcguard", False):
        return  # NIXL is not installed: vLLM says so when the worker starts

    def guarded_agent(name, config=None):
        from .nixl import GuardedNixlAgent
        return GuardedNixlAgent(name, config, agent_class=nixl_agent, mode=read_mode(),
                                guard_config={"listen": _listen()})

    guarded_agent._mcguard = True
    module.NixlWrapper = guarded_agent
    log.info("mcguard: vLLM %s's NIXL agent is GuardedNixlAgent (%s checks)", _vllm_version(), read_mode())


def _listen():
    """Where a worker's guard listens: MC_GUARD_LISTEN, else the host vLLM
    gives its side channel (VLLM_HOST_IP or its own guess)."""
    if os.environ.get("MC_GUARD_LISTEN"):
        return os.environ["MC_GUARD_LISTEN"]
    try:
        from vllm.utils.network_utils import get_ip
        host = get_ip()
    except Exception:  # noqa: BLE001 - an older layout: loopback, said in the log
        host = "127.0.0.1"
        log.warning("mcguard: no host from vLLM: the guard listens on loopback (set MC_GUARD_LISTEN)")
    return ("[%s]:0" if ":" in host else "%s:0") % host


def _wire_scheduler(cls):
    if getattr(cls, "_mcguard_wired", False):
        return

    def request_finished(orig):
        def fn(self, request, block_ids):
            delay, params = orig(self, request, block_ids)
            if delay and params and params.get("do_remote_prefill"):
                # What the decode side reads: the request's blocks as sent.
                _sealing(self)[request.request_id] = params["remote_block_ids"]
            return delay, params
        return fn

    def build_connector_meta(orig):
        def fn(self, scheduler_output):
            meta = orig(self, scheduler_output)
            meta.mcguard_sealing, self._mcguard_sealing = _sealing(self), {}
            return meta
        return fn

    wrap_methods(cls, {"request_finished": request_finished, "build_connector_meta": build_connector_meta})
    cls._mcguard_wired = True


def _sealing(scheduler):
    if not hasattr(scheduler, "_mcguard_sealing"):
        scheduler._mcguard_sealing = {}
    return scheduler._mcguard_sealing


def _wire_worker(cls):
    if getattr(cls, "_mcguard_wired", False):
        return
    read_params = inspect.signature(cls._read_blocks)

    def __init__(orig):
        def fn(self, *args, **kwargs):
            orig(self, *args, **kwargs)
            if not hasattr(self.nixl_wrapper, "publish_prepped"):
                raise RuntimeError("mcguard: the NixlConnector's agent is %s, not mcguard's: the plugin's agent "
                                   "switch did not take effect" % type(self.nixl_wrapper).__name__)
            self._mcguard_withdrawals = collections.deque()
        return fn

    def start_load_kv(orig):
        def fn(self, metadata):
            orig(self, metadata)
            sealing = getattr(metadata, "mcguard_sealing", None)
            if sealing:
                _publish(self, sealing)
        return fn

    def get_transfer_results(orig):
        def fn(self):
            results = orig(self)
            _withdraw(self, results.finished_sending)
            return results
        return fn

    def _read_blocks(orig):
        def fn(self, *args, **kwargs):
            name = read_params.bind(self, *args, **kwargs).arguments["remote_request_id"]
            with self.nixl_wrapper.sealed_by(name):
                return orig(self, *args, **kwargs)
        return fn

    wrap_methods(cls, {"__init__": __init__, "start_load_kv": start_load_kv,
                       "get_transfer_results": get_transfer_results, "_read_blocks": _read_blocks})
    cls._mcguard_wired = True
    log.info("mcguard: vLLM %s's NixlConnector: prefill seals its blocks, decode checks its reads",
             _vllm_version())


def _publish(worker, sealing):
    """Prefill side: seal and publish the blocks of each finished request
    that vLLM kept for the decode side to read (aborted ones it dropped)."""
    wanted = {r: b for r, b in sealing.items() if r in worker._reqs_to_send}
    if not wanted:
        return
    if any(t != "DRAM" for t in getattr(worker, "region_mem_types", None) or ("DRAM",)):
        _settle_device()
    if getattr(worker, "_mixed_mem_types", False):
        log.error("mcguard: KV regions of mixed memory types are not sealed (requests %s): their reads will fail",
                  sorted(wanted))
        return
    handle = worker.src_xfer_handles_by_block_size[worker.block_size]
    for req_id, block_ids in wanted.items():
        try:
            worker.nixl_wrapper.publish_prepped(req_id, handle, _desc_ids(worker, block_ids))
        except Exception as e:  # noqa: BLE001 - the decode side's read then fails: say why here
            log.error("mcguard: the seal of request %s's blocks was not published, so its reads will fail: %s",
                      req_id, e)


def _desc_ids(worker, block_ids):
    """The prefill worker's descriptor ids of block_ids (per KV group,
    logical), as its own READs' remote side counts them."""
    physical = worker._physical_blocks_per_logical_kv_block
    return worker._compute_desc_ids(
        block_ids=worker._logical_to_kernel_block_ids(block_ids, physical),
        dst_num_blocks=worker.dst_num_blocks[worker.engine_id],
        block_size_ratio=None,
        physical_blocks_per_logical=physical,
        region_num_blocks=worker.dst_region_num_blocks.get(worker.engine_id) or None,
        region_group_ids=worker.region_group_ids or None,
        uses_region_group_mapping=worker._uses_region_group_mapping)


def _settle_device():
    """The last step's kernels, which wrote the KV, done before it is sealed."""
    import torch
    torch.accelerator.synchronize()


def _withdraw(worker, finished_sending):
    """Withdraw the seals of requests whose blocks vLLM took back
    SEAL_GRACE_S ago; start the wait for those handed back now."""
    pending, now = worker._mcguard_withdrawals, time.monotonic()
    for req_id in finished_sending or ():
        pending.append((now + SEAL_GRACE_S, req_id))
    while pending and (pending[0][0] <= now or len(pending) > MAX_PENDING_WITHDRAWALS):
        _, req_id = pending.popleft()
        try:
            worker.nixl_wrapper.withdraw(req_id)
        except Exception:  # noqa: BLE001 - never published (aborted), or already aged out of the guard's store
            pass
