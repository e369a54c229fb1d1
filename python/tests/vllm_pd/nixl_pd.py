"""Prefill and decode in two processes through vLLM's own NixlConnector
(pull mode: its scheduler's request_finished and connector metadata, its
worker's handshake, descriptor lists, READs and load-error path), with
mcguard switched in by its vLLM plugin, on the CPU platform, NIXL's UCX
backend over TCP. Each process holds a real KV cache in torch tensors;
every block the decode side ends up with is hashed there and compared
with what it must hold.

    python nixl_pd.py CASE [--requests N] [--blocks N]

CASE is one of CASES below. Prints one line per request, then the case's
result as JSON on the last line (as pd.py).

Run with an interpreter that has vLLM and NIXL (make test-vllm's
environment).
"""

import argparse
import json
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from pd import BLOCK_SIZE, SECRET, KVCaches, decode_blocks, model_dir  # noqa: E402
from pd_common import PYTHON_DIR, finished_sending, free_port, plugin_metadata, run_pair, take_env  # noqa: E402

# Each case: the settings in both processes, and which request's blocks the
# prefill side hands to another request (number 100) after they were
# sealed and before the decode side reads them.
CASES = {
    "tail": dict(env={"MC_GUARD_VERIFY": "tail"}),
    "digest": dict(env={"MC_GUARD_VERIFY": "digest"}),
    "reuse-tail": dict(env={"MC_GUARD_VERIFY": "tail"}, reuse="0"),
    "reuse-digest": dict(env={"MC_GUARD_VERIFY": "digest"}, reuse="0"),
    # The control: no check, the same reuse.
    "reuse-off": dict(env={"MC_GUARD_VERIFY": "off"}, reuse="0"),
    # A prefill side without the plugin: nothing sealed, nothing received.
    "unsealed-prefill": dict(env={"MC_GUARD_VERIFY": "tail"}, prefill_env={"MC_GUARD_VLLM": "0"}),
}


class Side(KVCaches):
    """One vLLM process's NixlConnector, its scheduler and worker halves
    built as vLLM builds them, over a KV cache of real tensors."""

    def __init__(self, role, engine_id, dist_port, model):
        import torch
        torch.accelerator.current_device_index = lambda: 0  # PyPI's torch is a CUDA build (see pd.py)
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.distributed.kv_transfer.kv_connector.v1 import nixl
        self.nixl = nixl
        model_config = ModelConfig(model=model, skip_tokenizer_init=True, dtype="float32", max_model_len=2048)
        kv = KVTransferConfig(kv_connector="NixlConnector", kv_role=role, engine_id=engine_id,
                              kv_buffer_device="cpu", kv_connector_extra_config={"backends": ["UCX"]})
        config = VllmConfig(model_config=model_config, cache_config=CacheConfig(block_size=BLOCK_SIZE),
                            kv_transfer_config=kv)
        # What vLLM's engine core resolves before the workers start: the
        # layout the CPU backend and the connector share.
        config.cache_config.kv_cache_layout = "LBHNC"
        kv_cache_config = self.enter_worker(torch, config, dist_port)
        self.scheduler = nixl.NixlConnector(self.config, KVConnectorRole.SCHEDULER, kv_cache_config)
        self.connector = nixl.NixlConnector(self.config, KVConnectorRole.WORKER, kv_cache_config)
        self.worker = self.connector.connector_worker
        self.register_caches()
        if role == "kv_producer":
            # What vLLM's engine does once the workers registered: the
            # scheduler serves their agent metadata on the side channel.
            self.scheduler.set_xfer_handshake_metadata_pp_aware({(0, 0): self.connector.get_handshake_metadata()})

    def step(self):
        """One engine step: the scheduler's connector metadata, then the
        worker's start_load_kv with it."""
        self.connector.bind_connector_metadata(self.scheduler.build_connector_meta(None))
        self.connector.start_load_kv(None)
        self.connector.clear_connector_metadata()

    def stats(self):
        agent = self.worker.nixl_wrapper
        if not hasattr(agent, "guard"):
            return {"guarded": False}
        out = dict(agent.stats, guarded=True)
        out.update({k: v for k, v in agent.guard.stats().items() if k.startswith("seal")})
        return out


def prefill_main(conn, env, plan):
    take_env(env)
    from vllm import SamplingParams
    from vllm.v1.request import Request, RequestStatus
    side = Side("kv_producer", "prefill", plan["dist_ports"][0], plan["model"])
    params = {}
    for r, blocks in plan["prefill_blocks"].items():
        side.fill(int(r), blocks)
        req = Request("p-%s" % r, list(range(len(blocks) * BLOCK_SIZE)), SamplingParams(max_tokens=1), None)
        req.kv_transfer_params = {"do_remote_decode": True}
        side.scheduler.update_state_after_alloc(req, None, 0)
        req.num_computed_tokens = len(blocks) * BLOCK_SIZE
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        params[r] = req
    side.step()  # the requests scheduled
    for r, req in list(params.items()):
        _, params[r] = side.scheduler.request_finished_all_groups(req, ([*plan["prefill_blocks"][r]],))
    side.step()  # the requests finished: their blocks kept for the decode side
    if plan["reuse"] is not None:
        # The prefill side hands the request's blocks to another request
        # (as after an expired lease) before the decode side reads them.
        side.fill(100, plan["prefill_blocks"][plan["reuse"]])
    conn.send(("ready", params))
    def poll():
        side.step()
        return side.connector.get_finished(set())[0]
    sent, stopped = finished_sending(conn, len(plan["prefill_blocks"]), poll)
    conn.send(("sent", sent, side.stats()))
    if not stopped:
        conn.recv()  # stop
    os._exit(0)  # NIXL's UCX backend can crash in static destructors at exit


def decode_main(conn, env, plan):
    take_env(env)
    side = Side("kv_consumer", "decode", plan["dist_ports"][1], plan["model"])
    nixl = side.nixl
    conn.send(("ready", None))
    _, params = conn.recv()  # go, with the prefill's kv_transfer_params per request
    meta = nixl.NixlConnectorMetadata()
    for r, blocks in plan["decode_blocks"].items():
        meta.add_new_req_to_recv("d-%s" % r, ([*blocks],), params[r], awaiting_kvs=True)
    side.connector.bind_connector_metadata(meta)
    side.connector.start_load_kv(None)
    side.connector.clear_connector_metadata()
    pending = {"d-%s" % r for r in plan["decode_blocks"]}
    finished, errors, took = set(), set(), {}
    t0 = time.monotonic()
    while pending and time.monotonic() < t0 + plan["wait_s"]:
        # Later steps post the READs of requests whose handshake finished.
        side.connector.bind_connector_metadata(nixl.NixlConnectorMetadata())
        side.connector.start_load_kv(None)
        side.connector.clear_connector_metadata()
        _, recving = side.connector.get_finished(set())
        errors |= side.connector.get_block_ids_with_load_errors()
        for d in set(recving or ()) & pending:
            pending.discard(d)
            finished.add(d)
            took[d] = round(time.monotonic() - t0, 3)
        time.sleep(0.02)
    errors |= side.connector.get_block_ids_with_load_errors()
    result = {}
    for r, blocks in plan["decode_blocks"].items():
        owner = 100 if r == plan["reuse"] else int(r)
        good = sum(side.digest(b) == side.expected(int(r), i) for i, b in enumerate(blocks))
        d = "d-%s" % r
        result[r] = {"received": d in finished and not (set(blocks) & errors), "finished": d in finished,
                     "load_errors": sorted(set(blocks) & errors), "blocks": len(blocks), "good": good,
                     "bad": len(blocks) - good, "reused": owner == 100, "seconds": took.get(d)}
    conn.send(("result", result, side.stats()))
    conn.recv()
    os._exit(0)


def run(case, requests, blocks):
    spec = CASES[case]
    metadata, model = plugin_metadata("vllm.general_plugins"), model_dir()
    try:
        base = {"MC_GUARD_VLLM": "1", "VLLM_TARGET_DEVICE": "cpu", "VLLM_HOST_IP": "127.0.0.1",
                "MC_GUARD_SECRET": SECRET, "UCX_TLS": "tcp", "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
                "PYTHONPATH": os.pathsep.join([metadata, PYTHON_DIR, os.environ.get("PYTHONPATH", "")])}
        base.update(spec["env"])
        plan = {"prefill_blocks": {str(r): [r * blocks + i for i in range(blocks)] for r in range(requests)},
                "decode_blocks": {str(r): decode_blocks(r, blocks) for r in range(requests)},
                "model": model, "dist_ports": [free_port(), free_port()], "reuse": spec.get("reuse"),
                "wait_s": 30}
        prefill_env = dict(base, **spec.get("prefill_env", {}))
        _, result, decode_stats, sent, prefill_stats = run_pair(case, prefill_main, decode_main, prefill_env,
                                                                dict(base), plan)
    finally:
        shutil.rmtree(metadata, ignore_errors=True)
        shutil.rmtree(model, ignore_errors=True)
    import vllm
    out = {"case": case, "vllm": vllm.__version__, "requests": result, "prefill_finished_sending": sent,
           "decode_stats": decode_stats, "prefill_stats": prefill_stats}
    for r, x in sorted(result.items()):
        print("  [%s] request %s: %s, %d/%d blocks hash right%s%s" % (
            case, r, "received" if x["received"] else ("failed load" if x["finished"] else "never finished"),
            x["good"], x["blocks"], ", load errors %s" % x["load_errors"] if x["load_errors"] else "",
            " (reused by the prefill side before the read)" if x["reused"] else ""), flush=True)
    return out


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("case", choices=sorted(CASES))
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--blocks", type=int, default=3)
    a = p.parse_args(argv)
    print(json.dumps(run(a.case, a.requests, a.blocks)))


if __name__ == "__main__":
    sys.exit(main())
