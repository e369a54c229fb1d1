"""Device check for an NVIDIA machine with PyTorch (scripts/device-check.sh).

Two processes, each with KV-like tensors in GPU memory allocated by torch;
the prefill process writes blocks GPU-to-GPU over mcguard's TCP transport
in every verification mode, twice: staged through host memory and the
socket (same_host "off"), and by CUDA IPC, the decode process copying out
of the prefill's allocation device to device (same_host "auto", the
default on one host); the decode process's byte counters show which path
each run took. The decode process, after mc_guard_sync,
regenerates the expected blocks on its GPU from the same seeds and
compares them with torch.equal. With --expandable-segments both
processes allocate through PyTorch's expandable segments (VMM memory,
which has no legacy CUDA IPC handle: it goes by its shareable file
descriptor where PyTorch created it so, else it is staged, and the table
says which). Prints a table and writes it, as JSON, to --out. Needs build/libmcguard.so (built anywhere: it loads libcuda at run
time) and torch with CUDA.
"""

import argparse
import json
import multiprocessing as mp
import os
import sys
import time

from .cli import prog

MODES = ["off", "tail", "sample", "full", "digest"]
# How long the prefill process waits for one answer of the decode process.
ANSWER_SECONDS = 60.0
# same_host settings of the prefill guard: bytes staged through the
# socket, and CUDA IPC.
PATHS = [("socket", "off"), ("cuda-ipc", "auto")]


def blocks(torch, seed, n, block_bytes, device):
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return torch.randint(0, 256, (n, block_bytes), dtype=torch.uint8, device=device, generator=g)


def decode_main(conn, args):
    import torch

    import mcguard
    torch.cuda.set_device(0)
    kv = torch.zeros((args.blocks, args.block_bytes), dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    g = mcguard.Guard(cuda="required", notify="always")
    g.register(kv)
    conn.send((g.endpoint, kv.data_ptr(), g.stats()["cuda"]))
    stream = torch.cuda.current_stream()

    def check(msg):
        transfer_id, seed, first = msg
        try:
            g.sync_transfers([transfer_id], stream=stream)
        except mcguard.MCGuardError as e:
            return "failed", e.name
        want = blocks(torch, seed, args.batch, args.block_bytes, "cuda")
        got = kv[first:first + args.batch]
        return "ok", int((got != want).any(dim=1).sum().item())
    serve_pipe(conn, g, check)
    g.close()


def serve_pipe(conn, guard, handle):
    """A decode process's loop: each message on conn until "stop" is
    answered, "stats" with the guard's stats, any other with handle's."""
    while True:
        msg = conn.recv()
        if msg == "stop":
            return
        conn.send(guard.stats() if msg == "stats" else handle(msg))


class DecodeGone(Exception):
    """The decode process died or stopped answering."""


class Decode:
    """The prefill side's end of the pipe to the decode process: an answer
    that does not come (the process died, say, on a library that does not
    load) is an error at once, not a wait until the script's timeout."""

    def __init__(self, conn, proc):
        self.conn, self.proc = conn, proc

    def send(self, msg):
        self.conn.send(msg)

    def recv(self):
        deadline = time.monotonic() + ANSWER_SECONDS
        while not self.conn.poll(0.2):
            if not self.proc.is_alive():
                raise DecodeGone("the decode process exited with status %s" % self.proc.exitcode)
            if time.monotonic() > deadline:
                raise DecodeGone("the decode process gave no answer in %.0f s" % ANSWER_SECONDS)
        return self.conn.recv()


def run_mode(args, torch, mcguard, decode, endpoint, remote, path, same_host, mode):
    """One mode over one path for args.seconds: a row of the table."""
    decode.send("stats")
    before = decode.recv()
    g = mcguard.Guard(cuda="required", verify=mode, notify="always", same_host=same_host)
    src = torch.empty((args.batch, args.block_bytes), dtype=torch.uint8, device="cuda")
    g.register(src)
    transfers = ok = failed = mismatches = 0
    moved = 0
    start = time.monotonic()
    seed = 1000 * MODES.index(mode) + 100000 * [p for p, _ in PATHS].index(path)
    while time.monotonic() - start < args.seconds:
        seed += 1
        src.copy_(blocks(torch, seed, args.batch, args.block_bytes, "cuda"))
        torch.cuda.synchronize()
        first = (transfers * args.batch) % (args.blocks - args.batch + 1)
        srcs = [src[i].data_ptr() for i in range(args.batch)]
        dsts = [remote + (first + i) * args.block_bytes for i in range(args.batch)]
        transfers += 1
        try:
            res = g.transfer(endpoint, srcs, dsts, [args.block_bytes] * args.batch)
        except mcguard.MCGuardError as e:
            failed += 1
            print("  %s %s: %s" % (path, mode, e), file=sys.stderr)
            continue
        decode.send((res.id, seed, first))
        verdict, detail = decode.recv()
        if verdict == "failed":
            failed += 1
            continue
        ok += 1
        mismatches += detail
        moved += args.batch * args.block_bytes
    seconds = time.monotonic() - start
    g.close()
    decode.send("stats")
    after = decode.recv()
    ipc = after.get("same_host_ipc_bytes", 0) - before.get("same_host_ipc_bytes", 0)
    row = {"path": path, "verify": mode, "transfers": transfers, "ok": ok, "failed": failed, "mismatches": mismatches,
           "seconds": round(seconds, 3), "gbps": round(moved * 8 / 1e9 / seconds, 3), "ipc_bytes": ipc}
    print("%-8s %-6s transfers %5d ok %5d failed %3d mismatches %4d  %.3f Gbit/s  ipc bytes %d" % (
        path, mode, transfers, ok, failed, mismatches, row["gbps"], ipc), flush=True)
    return row


def main(argv=None):
    p = argparse.ArgumentParser(prog=prog("devicecheck"))
    p.add_argument("--out", default="build/device-check")
    p.add_argument("--blocks", type=int, default=256)
    p.add_argument("--block-bytes", type=int, default=256 << 10)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seconds", type=float, default=6.0, help="per mode and path")
    p.add_argument("--expandable-segments", action="store_true",
                   help="allocate through PyTorch's expandable segments (VMM memory), in both processes")
    args = p.parse_args(argv)
    if args.expandable_segments:  # before torch is imported, here and in the spawned decode process
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    import torch

    import mcguard
    if not torch.cuda.is_available():
        print("device check: torch sees no CUDA device", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    dec = ctx.Process(target=decode_main, args=(there, args), daemon=True)
    dec.start()
    decode = Decode(here, dec)
    rows = []
    try:
        endpoint, remote, decode_cuda = decode.recv()
        torch.cuda.set_device(0)
        for path, same_host in PATHS:
            for mode in MODES:
                rows.append(run_mode(args, torch, mcguard, decode, endpoint, remote, path, same_host, mode))
    except DecodeGone as e:
        print("device check: %s" % e, file=sys.stderr)
        return 1
    finally:
        if dec.is_alive():
            here.send("stop")
        dec.join(30)
    for r in rows:
        off = next(o["gbps"] for o in rows if o["verify"] == "off" and o["path"] == r["path"]) or 1e-9
        r["over_off"] = round(r["gbps"] / off, 3)
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "decode_cuda": decode_cuda,
              "batch": args.batch, "block_bytes": args.block_bytes, "expandable_segments": args.expandable_segments,
              "modes": rows}
    with open(os.path.join(args.out, "device-check.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result))
    took_its_path = all((r["ipc_bytes"] > 0) == (r["path"] == "cuda-ipc") for r in rows)
    if args.expandable_segments and all(r["ipc_bytes"] == 0 for r in rows):
        # PyTorch did not create its segments shareable as descriptors: they
        # are staged (logged by the library); the check is of the bytes.
        print("device check: expandable segments here are not shareable as file descriptors: every run staged",
              file=sys.stderr)
        took_its_path = True
    elif not took_its_path:
        print("device check: a run did not take the path it names (see ipc_bytes)", file=sys.stderr)
    return 0 if all(r["mismatches"] == 0 for r in rows if r["verify"] != "off") and all(r["ok"] > 0 for r in rows) and took_its_path else 1


if __name__ == "__main__":
    sys.exit(main())
