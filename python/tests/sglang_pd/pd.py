"""Prefill and decode in two processes through SGLang's own Mooncake KV
manager (its bootstrap server, ZeroMQ status messages, transfer worker
threads, sender and receiver), with mcguard switched in by its SGLang
plugin, on CPU tensors. Each room's KV pages (every layer's K and V) and
its metadata slot (the aux buffers) are hashed on the decode side and
compared with what they must hold.

    python pd.py CASE [--rooms N] [--pages N]

CASE is one of CASES below. Prints one line per room, then, last, the
case's result as JSON: SGLang's version, and per room the prefill's and
the decode's final status and how many pages (and the slot) hashed right.

Run with an interpreter that has SGLang (make test-sglang's environment).
"""

import argparse
import ctypes
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from pd_common import (DECODE_STATS, PREFILL_STATS, PYTHON_DIR, free_port, picked, plugin_metadata,  # noqa: E402
                       run_pair, take_env)

LAYERS, PAGES, PAGE_SIZE, HEADS, HEAD_DIM = 2, 64, 16, 2, 64
SLOTS = 16  # metadata slots (aux index) per side
SECRET = "sglang-pd-test-secret-0123456789"
REUSED = 100  # the request a reused page or slot belongs to after an abort

CASES = {
    "tail": dict(env={"MC_GUARD_VERIFY": "tail"}),
    "digest": dict(env={"MC_GUARD_VERIFY": "digest"}),
    "tail-socket": dict(env={"MC_GUARD_VERIFY": "tail", "MC_GUARD_SAME_HOST": "off"}),
    "digest-socket": dict(env={"MC_GUARD_VERIFY": "digest", "MC_GUARD_SAME_HOST": "off"}),
    "mooncake-tail": dict(env={"MC_GUARD_VERIFY": "tail", "MC_GUARD_SGLANG_ENGINE": "mooncake"}),
    "mooncake-digest": dict(env={"MC_GUARD_VERIFY": "digest", "MC_GUARD_SGLANG_ENGINE": "mooncake"}),
    # A fault at the receiver: every write dropped.
    "drop-tail": dict(env={"MC_GUARD_VERIFY": "tail", "MC_GUARD_SAME_HOST": "off"}, fault="drop"),
    "drop-digest": dict(env={"MC_GUARD_VERIFY": "digest", "MC_GUARD_SAME_HOST": "off"}, fault="drop"),
    "drop-off": dict(env={"MC_GUARD_VERIFY": "off", "MC_GUARD_SAME_HOST": "off"}, fault="drop"),
    # The decode side aborts room 0 while its write is held back at the
    # decode guard, and SGLang's release gives its pages and slot to a new
    # request at once.
    "abort": dict(env={"MC_GUARD_VERIFY": "tail", "MC_GUARD_SAME_HOST": "off"}, abort=True),
    # The same with SGLang's deferred release on: freed at once all the same.
    "abort-deferred": dict(env={"MC_GUARD_VERIFY": "tail", "MC_GUARD_SAME_HOST": "off",
                                "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE": "1"}, abort=True, deferred=True),
    "abort-no-quiesce": dict(env={"MC_GUARD_VERIFY": "tail", "MC_GUARD_SAME_HOST": "off",
                                  "MC_GUARD_SGLANG_QUIESCE": "0"}, abort=True),
    # The same over Mooncake's engine: the write is held at the prefill's
    # engine callbacks, and the quiesce is kept there.
    "mooncake-abort": dict(env={"MC_GUARD_VERIFY": "tail", "MC_GUARD_SGLANG_ENGINE": "mooncake"}, abort=True),
    "mooncake-abort-no-quiesce": dict(env={"MC_GUARD_VERIFY": "tail", "MC_GUARD_SGLANG_ENGINE": "mooncake",
                                           "MC_GUARD_SGLANG_QUIESCE": "0"}, abort=True),
    # The prefill's write fails at its deadline while held back; the decode
    # side does not quiesce, so only the prefill's abort keeps it out.
    "failed-send": dict(env={"MC_GUARD_VERIFY": "tail", "MC_GUARD_SAME_HOST": "off",
                             "MC_GUARD_SGLANG_QUIESCE": "0"}, failed_send=True),
}
HOLD_MS = 4000


def model_dir():
    d = tempfile.mkdtemp(prefix="mcguard-sglang-model-")
    # A small Llama's config: SGLang's server arguments read it; no weights
    # are loaded (only the KV manager runs).
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
                   "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": HEADS,
                   "head_dim": HEAD_DIM, "num_hidden_layers": LAYERS, "vocab_size": 1000,
                   "max_position_embeddings": 4096, "torch_dtype": "float32", "rms_norm_eps": 1e-5}, f)
    return d


def content(seed, n):
    """n bytes, the same in every process for one seed."""
    return random.Random(seed).randbytes(n)


def page_seed(request, entry, i):
    return 1_000_000 * (request + 1) + 1000 * entry + i


class Side:
    """One SGLang scheduler's Mooncake KV manager over real CPU tensors: the
    KV pool (K and V per layer, paged) and the metadata buffers."""

    def __init__(self, mode, bootstrap_port, model):
        # What SGLang's scheduler process does first: its general plugins,
        # mcguard's among them (MC_GUARD_SGLANG=1 switches it on).
        from sglang.srt.plugins import load_plugins
        load_plugins()
        import torch
        from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish
        from sglang.srt.server_args import ServerArgs
        args = ServerArgs(model_path=model, disaggregation_mode=mode, disaggregation_transfer_backend="mooncake",
                          device="cpu", disaggregation_bootstrap_port=bootstrap_port, host="127.0.0.1",
                          skip_tokenizer_init=True)
        publish(args, role="scheduler", ranks=SpawnRanks(world_rank=0))
        get_parallel().override_permanently(pp_group=None)  # one process: no pipeline group
        from sglang.srt.disaggregation.base import KVArgs
        from sglang.srt.disaggregation.mooncake import conn
        from sglang.srt.disaggregation.utils import DisaggregationMode, MetadataBuffers
        from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
            init_mooncake_transfer_engine)
        if mode == "prefill":
            self.server = conn.MooncakeKVBootstrapServer("127.0.0.1", bootstrap_port)
        init_mooncake_transfer_engine(hostname="127.0.0.1", gpu_id=0)
        self.conn, self.mode = conn, mode
        self.kv = [torch.zeros((PAGES * PAGE_SIZE, HEADS, HEAD_DIM), dtype=torch.float32)
                   for _ in range(2 * LAYERS)]
        self.meta = MetadataBuffers(SLOTS, hidden_size=256, hidden_states_dtype=torch.float32,
                                    max_sampling_mask_tokens=1)
        a = KVArgs()
        a.engine_rank, a.pp_rank, a.system_dp_rank, a.rust_http_port = 0, 0, 0, None
        a.kv_cache_dtype_str, a.kv_layout, a.prefill_start_layer, a.prefill_end_layer = "float32", None, 0, LAYERS
        a.kv_data_ptrs = [t.data_ptr() for t in self.kv]
        a.kv_data_lens = [t.nbytes for t in self.kv]
        a.kv_item_lens = [t[0].nbytes * PAGE_SIZE for t in self.kv]
        a.num_draft_entries, a.kv_layer_ids = 0, []
        a.kv_head_num, a.total_kv_head_num, a.page_size = HEADS, HEADS, PAGE_SIZE
        a.aux_data_ptrs, a.aux_data_lens, a.aux_item_lens = self.meta.get_buf_infos()
        a.ib_device, a.gpu_id = None, 0
        a.state_types, a.state_data_ptrs, a.state_data_lens, a.state_item_lens = [], [], [], []
        a.state_dim_per_tensor, a.state_slice_outer_counts, a.state_layer_ids = [], [], []
        a.is_hybrid_mla_backend, a.state_conv_shard_groups, a.swa_kv_cache_layout = False, [], None
        self.args = a
        role = DisaggregationMode.PREFILL if mode == "prefill" else DisaggregationMode.DECODE
        self.mgr = conn.MooncakeKVManager(a, role, args, False)

    def guard(self):
        return self.mgr.engine.engine.guard

    def regions(self, pages, slot):
        """(addr, len) of each page of every KV entry, then of each aux
        buffer's slot."""
        out = [(ptr + p * n, n) for ptr, n in zip(self.args.kv_data_ptrs, self.args.kv_item_lens) for p in pages]
        return out + [(ptr + slot * n, n) for ptr, n in zip(self.args.aux_data_ptrs, self.args.aux_item_lens)]

    def fill(self, request, pages, slot):
        for i, (addr, n) in enumerate(self.regions(pages, slot)):
            ctypes.memmove(addr, content(page_seed(request, 0, i), n), n)

    def hashes(self, pages, slot):
        return [hashlib.sha256(ctypes.string_at(a, n)).hexdigest() for a, n in self.regions(pages, slot)]

    def expected(self, request, pages, slot):
        return [hashlib.sha256(content(page_seed(request, 0, i), n)).hexdigest()
                for i, (_, n) in enumerate(self.regions(pages, slot))]


def final(poll_fn, deadline):
    """The name of the status poll_fn ends at (Success, Failed), or where
    it stands at deadline."""
    from sglang.srt.disaggregation.base import KVPoll
    names = {v: k for k, v in vars(KVPoll).items() if isinstance(v, int) and not k.startswith("_")}
    while time.monotonic() < deadline:
        p = poll_fn()
        if p in (KVPoll.Success, KVPoll.Failed):
            break
        time.sleep(0.02)
    return names.get(poll_fn(), str(poll_fn()))


def prefill_main(conn, env, plan):
    take_env(env)
    side = Side("prefill", plan["bootstrap_port"], plan["model"])
    from sglang.srt.disaggregation.base import KVPoll
    import numpy as np
    rooms = plan["rooms"]
    for r, (pages, slot) in rooms.items():
        side.fill(int(r), pages, slot)
    senders = {r: side.conn.MooncakeKVSender(side.mgr, "127.0.0.1:%d" % plan["bootstrap_port"], int(r) + 1)
               for r in rooms}
    conn.send(("ready", side.guard().stats().get("transport")))
    deadline = time.monotonic() + 60
    started = set()
    while len(started) < len(senders) and time.monotonic() < deadline:
        for r, s in senders.items():
            if r not in started and s.poll() in (KVPoll.WaitingForInput, KVPoll.Failed):
                if s.poll() == KVPoll.WaitingForInput:  # the decode side's pages and slot are known: send
                    pages, slot = rooms[r]
                    s.init(len(pages), aux_index=slot)
                    s.send(np.array(pages, dtype=np.int32))
                started.add(r)
        time.sleep(0.02)
    status = {r: final(s.poll, deadline) for r, s in senders.items()}
    conn.recv()  # stop: the decode side is done, its quiesces kept here included
    conn.send(("sent", status, side.guard().stats()))
    os._exit(0)  # SGLang's threads and the guard go with the process


def release_pages(side, receiver, slot, freed, deferred):
    """SGLang's release of a failed request's pages and metadata slot
    (DecodeTransferQueue._release_request, or _defer_release where its
    deferred release is on; the plugin's quiesce before either), over a
    scheduler of its own: its KV release records what it frees."""
    from sglang.srt.disaggregation import decode
    queue = object.__new__(decode.DecodeTransferQueue)
    queue.scheduler = types.SimpleNamespace(enable_hisparse=False)
    queue.enable_host_receive, queue.tree_cache, queue.enable_staging = False, None, False
    queue.metadata_buffers = side.meta
    queue.req_to_metadata_buffer_idx_allocator = types.SimpleNamespace(free=lambda idx: None)
    queue.deferred_kv_release_timeout, queue._deferred_releases = 30, []
    decode.release_kv_cache = lambda req, tree_cache, checkpoint=False: freed.append(req.rid)
    room = receiver.bootstrap_room
    req = types.SimpleNamespace(req=types.SimpleNamespace(rid=room, bootstrap_room=room), kv_receiver=receiver,
                                metadata_buffer_index=slot)
    if deferred:
        queue._defer_release(req)
    else:
        queue._release_request(req)


def decode_main(conn, env, plan):
    take_env(env)
    side = Side("decode", plan["bootstrap_port"], plan["model"])
    import numpy as np
    conn.send(("ready", None))
    conn.recv()  # go
    addr = "127.0.0.1:%d" % plan["bootstrap_port"]
    deadline = time.monotonic() + 30
    while not side.mgr.try_ensure_parallel_info(addr):
        if time.monotonic() > deadline:
            raise RuntimeError("no parallel info from the prefill's bootstrap server at %s" % addr)
        time.sleep(0.1)
    receivers = {}
    for r, (pages, slot) in plan["decode_rooms"].items():
        rcv = side.conn.MooncakeKVReceiver(side.mgr, addr, int(r) + 1)
        rcv.init(0)
        rcv.send_metadata(np.array(pages, dtype=np.int32), slot)
        receivers[r] = rcv
    t0 = time.monotonic()
    owner, freed = {r: int(r) for r in receivers}, []
    if plan["abort"]:
        time.sleep(1.0)  # room 0's write is held at this side's guard now
        receivers["0"].abort()
        release_pages(side, receivers["0"], plan["decode_rooms"]["0"][1], freed, plan["deferred"])
        side.fill(REUSED, *plan["decode_rooms"]["0"])  # a new request's KV, in the released pages, at once
        owner["0"] = REUSED
    status, took = {}, {}
    for r, rcv in receivers.items():
        status[r] = final(rcv.poll, t0 + plan["wait_s"])
        took[r] = round(time.monotonic() - t0, 3)
    time.sleep(plan["settle_s"])  # anything still on its way (a held write) has had its chance to land
    result = {}
    for r, (pages, slot) in plan["decode_rooms"].items():
        got, want = side.hashes(pages, slot), side.expected(owner[r], pages, slot)
        good = [g == w for g, w in zip(got, want)]
        result[r] = {"status": status[r], "pages": len(pages), "regions": len(good), "good": sum(good),
                     "bad": len(good) - sum(good), "slot_good": all(good[len(pages) * 2 * LAYERS:]),
                     "owner": owner[r], "released": int(r) + 1 in freed, "seconds": took[r]}
    conn.send(("result", result, side.guard().stats()))
    conn.recv()
    os._exit(0)


def run(case, rooms, pages):
    metadata, model = plugin_metadata("sglang.srt.plugins"), model_dir()
    try:
        return run_in(case, rooms, pages, CASES[case], metadata, model)
    finally:
        shutil.rmtree(metadata, ignore_errors=True)
        shutil.rmtree(model, ignore_errors=True)


def run_in(case, rooms, pages, spec, metadata, model):
    base = {"MC_GUARD_SGLANG": "1", "MC_GUARD_SECRET": SECRET, "MOONCAKE_PROTOCOL": "tcp", "MC_FORCE_TCP": "1",
            "SGLANG_HOST_IP": "127.0.0.1",
            "PYTHONPATH": os.pathsep.join([metadata, PYTHON_DIR, os.environ.get("PYTHONPATH", "")])}
    base.update(spec["env"])
    if spec.get("abort") or spec.get("failed_send"):
        rooms = 1  # its write is the one held
    # The decode side's pages: not the prefill's, and in reverse order;
    # its slots counted down from the last.
    plan = {"rooms": {str(r): ([r * pages + i for i in range(pages)], r) for r in range(rooms)},
            "decode_rooms": {str(r): ([PAGES - 1 - (r * pages + i) for i in range(pages)], SLOTS - 1 - r)
                             for r in range(rooms)},
            "model": model, "bootstrap_port": free_port(), "abort": bool(spec.get("abort")),
            "deferred": bool(spec.get("deferred")), "wait_s": 45,
            "settle_s": 0.5}
    prefill_env, decode_env = dict(base), dict(base)
    if spec.get("fault") == "drop":
        decode_env.update(MC_GUARD_INJECT="drop", MC_GUARD_INJECT_RATE="1.0")
    if spec.get("abort") or spec.get("failed_send"):
        # Where a write is held back: at the decode guard's target, or over
        # Mooncake's engine (which the decode guard does not see) at the
        # prefill guard's engine callbacks.
        held = prefill_env if spec["env"].get("MC_GUARD_SGLANG_ENGINE") == "mooncake" else decode_env
        held.update(MC_GUARD_INJECT="hold", MC_GUARD_INJECT_RATE="1.0", MC_GUARD_INJECT_LAG_MAX_MS=str(HOLD_MS))
        plan["settle_s"] = HOLD_MS / 1000 + 2
    if spec.get("failed_send"):
        prefill_env["MC_GUARD_TIMEOUT_MS"] = "1500"  # the write's deadline, before the held write lands
    transport, result, decode_stats, sent, prefill_stats = run_pair(case, prefill_main, decode_main, prefill_env,
                                                                    decode_env, plan)
    import sglang
    out = {"case": case, "sglang": sglang.__version__, "rooms": result, "prefill_status": sent,
           "prefill_transport": transport,
           "decode_stats": picked(decode_stats, DECODE_STATS),
           "prefill_stats": picked(prefill_stats, PREFILL_STATS)}
    for r, x in sorted(result.items()):
        print("  [%s] room %s: prefill %s, decode %s; %d/%d pages and the slot: %d/%d regions hash right%s" % (
            case, r, sent.get(r), x["status"], x["pages"], x["pages"], x["good"], x["regions"],
            " (now request %d's)" % x["owner"] if x["owner"] != int(r) else ""), flush=True)
    return out


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("case", choices=sorted(CASES))
    p.add_argument("--rooms", type=int, default=4)
    p.add_argument("--pages", type=int, default=3)
    a = p.parse_args(argv)
    print(json.dumps(run(a.case, a.rooms, a.pages)))


if __name__ == "__main__":
    sys.exit(main())
