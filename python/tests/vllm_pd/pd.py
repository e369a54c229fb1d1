"""Prefill and decode in two processes through vLLM's own MooncakeConnector
worker (its bootstrap server, ZeroMQ side channel, block coalescing and
sender thread pool), with mcguard switched in by its vLLM plugin, on the
CPU platform. Each process holds a real KV cache in torch tensors; every
block the decode side ends up with is hashed there and compared with what
it must hold.

    python pd.py CASE [--requests N] [--blocks N]

CASE is one of CASES below. Prints one line per request, then a summary
line and, last, the case's result as JSON: the vLLM version, and per
request whether vLLM reported it received or failed, its blocks reported
as load errors, and how many blocks hashed right or wrong.

Run with an interpreter that has vLLM (make test-vllm's environment).
"""

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from pd_common import (DECODE_STATS, PREFILL_STATS, PYTHON_DIR, finished_sending, free_port, picked,  # noqa: E402
                       plugin_metadata, run_pair, take_env)

BLOCK_SIZE = 32  # tokens; vLLM's CPU platform wants a multiple of 32
HEADS, HEAD_SIZE = 2, 64
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
NUM_BLOCKS = 128
SECRET = "vllm-pd-test-secret-0123456789"

# Each case: the plugin's settings in both processes (env), and the
# decode or prefill process's own on top (faults are the receiver's).
CASES = {
    "tail": dict(env={"MC_GUARD_VERIFY": "tail"}),
    "digest": dict(env={"MC_GUARD_VERIFY": "digest"}),
    "tail-socket": dict(env={"MC_GUARD_VERIFY": "tail", "MC_GUARD_SAME_HOST": "off"}),
    "digest-socket": dict(env={"MC_GUARD_VERIFY": "digest", "MC_GUARD_SAME_HOST": "off"}),
    "mooncake-tail": dict(env={"MC_GUARD_VERIFY": "tail", "MC_GUARD_VLLM_ENGINE": "mooncake"}),
    "mooncake-digest": dict(env={"MC_GUARD_VERIFY": "digest", "MC_GUARD_VLLM_ENGINE": "mooncake"}),
    # A fault at the receiver: every write of every other request dropped.
    "drop-tail": dict(env={"MC_GUARD_VERIFY": "tail", "MC_GUARD_SAME_HOST": "off"}, fault="drop"),
    "drop-digest": dict(env={"MC_GUARD_VERIFY": "digest", "MC_GUARD_SAME_HOST": "off"}, fault="drop"),
    "drop-off": dict(env={"MC_GUARD_VERIFY": "off", "MC_GUARD_SAME_HOST": "off"}, fault="drop"),
    # The decode side gives up on request 0 while its write is held back,
    # and gives its blocks to a new request at once.
    "abort": dict(env={"MC_GUARD_VERIFY": "tail", "MC_GUARD_SAME_HOST": "off"}, abort=True),
    "abort-no-quiesce": dict(env={"MC_GUARD_VERIFY": "tail", "MC_GUARD_SAME_HOST": "off",
                                  "MC_GUARD_VLLM_QUIESCE": "0"}, abort=True),
    # The same over Mooncake's engine: the write is held at the prefill's
    # engine callbacks, and the quiesce is kept there.
    "mooncake-abort": dict(env={"MC_GUARD_VERIFY": "tail", "MC_GUARD_VLLM_ENGINE": "mooncake"}, abort=True),
    "mooncake-abort-no-quiesce": dict(env={"MC_GUARD_VERIFY": "tail", "MC_GUARD_VLLM_ENGINE": "mooncake",
                                           "MC_GUARD_VLLM_QUIESCE": "0"}, abort=True),
    # The prefill side's write fails at its deadline while held back; the
    # decode side does not quiesce, so only the prefill's abort keeps the
    # held write out.
    "failed-send": dict(env={"MC_GUARD_VERIFY": "tail", "MC_GUARD_SAME_HOST": "off"}, failed_send=True),
}

# The abort cases: the decode side's ZeroMQ wait for the prefill's answer
# is (VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT + 60) s; -58 makes it 2 s, so
# vLLM's own timeout path gives up while the write is held for HOLD_MS.
ABORT_TIMEOUT = "-58"
HOLD_MS = 4000


def decode_blocks(request, blocks):
    """The decode side's blocks for a request: not the prefill's, and in
    reverse order."""
    return [NUM_BLOCKS - 1 - (request * blocks + i) for i in range(blocks)]


def block_bytes(torch, seed, shape):
    """A block's content, the same in every process for one seed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float32)


def seed_of(request, layer, i):
    return 1_000_000 * (request + 1) + 1000 * layer + i


def model_dir():
    d = tempfile.mkdtemp(prefix="mcguard-vllm-model-")
    # A small Llama's config: vLLM reads it for the KV layout; no weights
    # are loaded (only the connector runs).
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HEADS * HEAD_SIZE * 2,
                   "intermediate_size": 512, "num_attention_heads": HEADS * 2, "num_key_value_heads": HEADS,
                   "head_dim": HEAD_SIZE, "num_hidden_layers": len(LAYERS), "vocab_size": 1000,
                   "max_position_embeddings": 4096, "torch_dtype": "float32", "rms_norm_eps": 1e-5}, f)
    return d


class KVCaches:
    """What both connectors' test processes share: vLLM's configuration
    entered as its worker enters it, the KV cache config and its block-major
    tensors (block b of a layer is caches[layer][b]), and their contents."""

    def enter_worker(self, torch, config, dist_port):
        """Enters config as vLLM's worker does and returns the KVCacheConfig
        of NUM_BLOCKS blocks per layer; sets self.torch, self.config and
        self.shape."""
        from vllm.config import set_current_vllm_config
        from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
        self.torch, self.config = torch, config
        spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.float32)
        page = spec.page_size_bytes
        kv_cache_config = KVCacheConfig(
            num_blocks=NUM_BLOCKS,
            kv_cache_tensors=[KVCacheTensor(size=page * NUM_BLOCKS, layers=[name], layer_stride=page * NUM_BLOCKS,
                                            block_stride=page) for name in LAYERS],
            kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)])
        self.shape = (2, BLOCK_SIZE, HEADS, HEAD_SIZE)
        self._ctx = set_current_vllm_config(config)
        self._ctx.__enter__()
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method="tcp://127.0.0.1:%d" % dist_port)
        ensure_model_parallel_initialized(1, 1)
        return kv_cache_config

    def register_caches(self):
        self.caches = {name: self.torch.zeros((NUM_BLOCKS,) + self.shape, dtype=self.torch.float32)
                       for name in LAYERS}
        self.connector.register_kv_caches(self.caches)

    def fill(self, request, blocks):
        for li, name in enumerate(LAYERS):
            for i, b in enumerate(blocks):
                self.caches[name][b].copy_(block_bytes(self.torch, seed_of(request, li, i), self.shape))

    def digest(self, b):
        h = hashlib.sha256()
        for name in LAYERS:
            h.update(self.caches[name][b].numpy().tobytes())
        return h.hexdigest()

    def expected(self, request, i):
        h = hashlib.sha256()
        for li in range(len(LAYERS)):
            h.update(block_bytes(self.torch, seed_of(request, li, i), self.shape).numpy().tobytes())
        return h.hexdigest()


class Side(KVCaches):
    """One vLLM worker process's connector, built as vLLM's model runner
    builds it, over a KV cache of real tensors."""

    def __init__(self, role, engine_id, dist_port, model):
        import torch
        # The one stand-in: PyPI's torch is a CUDA build, and the worker
        # asks it for the current device, which needs a CUDA driver.
        torch.accelerator.current_device_index = lambda: 0
        # What vLLM's worker process does first: its general plugins,
        # mcguard's among them (MC_GUARD_VLLM=1 switches it on).
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import mooncake_connector as mc
        self.mc = mc
        model_config = ModelConfig(model=model, skip_tokenizer_init=True, dtype="float32", max_model_len=2048)
        kv = KVTransferConfig(kv_connector="MooncakeConnector", kv_role=role, engine_id=engine_id,
                              kv_connector_extra_config={"mooncake_protocol": "tcp"})
        config = VllmConfig(model_config=model_config, cache_config=CacheConfig(block_size=BLOCK_SIZE),
                            kv_transfer_config=kv)
        kv_cache_config = self.enter_worker(torch, config, dist_port)
        self.connector = mc.MooncakeConnector(self.config, KVConnectorRole.WORKER, kv_cache_config)
        self.worker = self.connector.connector_worker
        self.register_caches()

    def start(self, meta):
        self.connector.bind_connector_metadata(meta)
        self.connector.start_load_kv(None)
        self.connector.clear_connector_metadata()


def prefill_main(conn, env, plan):
    take_env(env)
    side = Side("kv_producer", "prefill", plan["dist_ports"][0], plan["model"])
    mc = side.mc
    for r, blocks in plan["prefill_blocks"].items():
        side.fill(int(r), blocks)
    # As vLLM's scheduler tells the worker: the request once its blocks
    # are allocated (no blocks yet), then again when its prefill finished.
    for step in ("allocated", "finished"):
        meta = mc.MooncakeConnectorMetadata()
        for r, blocks in plan["prefill_blocks"].items():
            meta.reqs_to_send["p-%s" % r] = ("t-%s" % r, [list(blocks)] if step == "finished" else [])
        side.start(meta)
    conn.send(("ready", side.worker.engine.guard.stats().get("transport")))
    sent, stopped = finished_sending(conn, len(plan["prefill_blocks"]),
                                     lambda: side.connector.get_finished(set())[0])
    conn.send(("sent", sent, side.worker.engine.guard.stats()))
    if not stopped:
        conn.recv()  # stop
    os._exit(0)  # vLLM's threads and the guard go with the process


def decode_main(conn, env, plan):
    take_env(env)
    side = Side("kv_consumer", "decode", plan["dist_ports"][1], plan["model"])
    mc = side.mc
    conn.send(("ready", None))
    conn.recv()  # go
    meta = mc.MooncakeConnectorMetadata()
    for r, blocks in plan["decode_blocks"].items():
        meta.reqs_to_recv["prefill"]["d-%s" % r] = mc.PullReqMeta(
            d_req_id="d-%s" % r, transfer_id="t-%s" % r, local_block_ids=[list(blocks)],
            remote_engine_id="prefill", remote_bootstrap_addr="http://127.0.0.1:%d" % plan["bootstrap_port"])
    side.start(meta)
    pending = {"d-%s" % r for r in plan["decode_blocks"]}
    finished, errors, took = set(), set(), {}
    t0 = time.monotonic()
    deadline = t0 + plan["wait_s"]
    reused = {}
    while pending and time.monotonic() < deadline:
        _, recving = side.connector.get_finished(set())
        errors |= side.connector.get_block_ids_with_load_errors()
        for d in set(recving or ()) & pending:
            pending.discard(d)
            finished.add(d)
            took[d] = round(time.monotonic() - t0, 3)
            r = d[2:]
            if plan["abort"] and r == "0":
                # vLLM frees a failed request's blocks now: a new request
                # (number 100) computes its own KV into them at once.
                side.fill(100, plan["decode_blocks"][r])
                reused[r] = plan["decode_blocks"][r]
        time.sleep(0.02)
    errors |= side.connector.get_block_ids_with_load_errors()
    # Anything still on its way (a held write) has had its chance to land.
    time.sleep(plan["settle_s"])
    errors |= side.connector.get_block_ids_with_load_errors()
    result = {}
    for r, blocks in plan["decode_blocks"].items():
        owner = 100 if r in reused else int(r)
        good = sum(side.digest(b) == side.expected(owner, i) for i, b in enumerate(blocks))
        d = "d-%s" % r
        result[r] = {"received": d in finished and not (set(blocks) & errors), "finished": d in finished,
                     "load_errors": sorted(set(blocks) & errors), "blocks": len(blocks), "good": good,
                     "bad": len(blocks) - good, "owner": owner, "seconds": took.get(d)}
    conn.send(("result", result, side.worker.engine.guard.stats()))
    conn.recv()
    os._exit(0)


def run(case, requests, blocks):
    spec = CASES[case]
    metadata, model = plugin_metadata("vllm.general_plugins"), model_dir()
    try:
        try:
            return run_in(case, requests, blocks, spec, metadata, model)
        except RuntimeError as e:
            # Its ports are picked free, then bound later by vLLM: another
            # process can take one in between (EADDRINUSE at start). Once
            # more on new ports; a real start failure fails again.
            if "before 'ready'" not in str(e):
                raise
            print("  [%s] a side did not start (%s): once more on new ports" % (case, e), flush=True)
            return run_in(case, requests, blocks, spec, metadata, model)
    finally:
        shutil.rmtree(metadata, ignore_errors=True)
        shutil.rmtree(model, ignore_errors=True)


def run_in(case, requests, blocks, spec, metadata, model):
    base = {"MC_GUARD_VLLM": "1", "VLLM_TARGET_DEVICE": "cpu", "VLLM_HOST_IP": "127.0.0.1",
            "MC_GUARD_SECRET": SECRET,
            "PYTHONPATH": os.pathsep.join([metadata, PYTHON_DIR, os.environ.get("PYTHONPATH", "")])}
    base.update(spec["env"])
    plan = {"prefill_blocks": {str(r): [r * blocks + i for i in range(blocks)] for r in range(requests)},
            "decode_blocks": {str(r): decode_blocks(r, blocks) for r in range(requests)},
            "model": model, "bootstrap_port": free_port(), "dist_ports": [free_port(), free_port()],
            "abort": bool(spec.get("abort")), "wait_s": 45, "settle_s": 0.5}
    prefill_env = dict(base, VLLM_MOONCAKE_BOOTSTRAP_PORT=str(plan["bootstrap_port"]))
    decode_env = dict(base)
    if spec.get("fault") == "drop":
        # Every write to the decode side dropped; the prefill sends each
        # request as its own batch, so every request is hit.
        decode_env.update(MC_GUARD_INJECT="drop", MC_GUARD_INJECT_RATE="1.0")
    if spec.get("abort") or spec.get("failed_send"):
        # Where a write is held back: at the decode guard's target, or over
        # Mooncake's engine (which the decode guard does not see) at the
        # prefill guard's engine callbacks.
        held = prefill_env if spec["env"].get("MC_GUARD_VLLM_ENGINE") == "mooncake" else decode_env
        held.update(MC_GUARD_INJECT="hold", MC_GUARD_INJECT_RATE="1.0", MC_GUARD_INJECT_LAG_MAX_MS=str(HOLD_MS))
        plan["settle_s"] = HOLD_MS / 1000 + 2
    if spec.get("abort"):
        decode_env["VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT"] = ABORT_TIMEOUT
        # One request: its write is the one held when the decode side gives up.
        plan["prefill_blocks"] = {"0": plan["prefill_blocks"]["0"]}
        plan["decode_blocks"] = {"0": plan["decode_blocks"]["0"]}
    if spec.get("failed_send"):
        prefill_env["MC_GUARD_TIMEOUT_MS"] = "1500"  # the write's deadline, before the held write lands
        decode_env["MC_GUARD_VLLM_QUIESCE"] = "0"
        plan["prefill_blocks"] = {"0": plan["prefill_blocks"]["0"]}
        plan["decode_blocks"] = {"0": plan["decode_blocks"]["0"]}
    transport, result, decode_stats, sent, prefill_stats = run_pair(case, prefill_main, decode_main, prefill_env,
                                                                    decode_env, plan)
    import vllm
    out = {"case": case, "vllm": vllm.__version__, "requests": result, "prefill_finished_sending": sent,
           "prefill_transport": transport,
           "decode_stats": picked(decode_stats, DECODE_STATS),
           "prefill_stats": picked(prefill_stats, PREFILL_STATS)}
    for r, x in sorted(result.items()):
        print("  [%s] request %s: %s, %d/%d blocks hash right%s%s" % (
            case, r, "received" if x["received"] else ("failed load" if x["finished"] else "never finished"),
            x["good"], x["blocks"], ", load errors %s" % x["load_errors"] if x["load_errors"] else "",
            " (now request %d's)" % x["owner"] if x["owner"] != int(r) else ""), flush=True)
    return out


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("case", choices=sorted(CASES))
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--blocks", type=int, default=3)
    a = p.parse_args(argv)
    out = run(a.case, a.requests, a.blocks)
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
