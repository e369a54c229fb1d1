"""Device check for an NVIDIA machine with PyTorch (scripts/device-check.sh).

Two processes, each with KV-like tensors in GPU memory allocated by torch;
the prefill process writes blocks GPU-to-GPU over mcguard's TCP transport
in every verification mode, and the decode process, after mc_guard_sync,
regenerates the expected blocks on its GPU from the same seeds and
compares them with torch.equal. Prints a table and writes it, as JSON, to
--out. Needs build/libmcguard.so (built anywhere: it loads libcuda at run
time) and torch with CUDA.
"""

import argparse
import json
import multiprocessing as mp
import os
import sys
import time

MODES = ["off", "tail", "sample", "full", "digest"]


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
    while True:
        msg = conn.recv()
        if msg == "stop":
            break
        transfer_id, seed, first = msg
        try:
            g.sync_transfers([transfer_id], stream=stream)
        except mcguard.MCGuardError as e:
            conn.send(("failed", e.name))
            continue
        want = blocks(torch, seed, args.batch, args.block_bytes, "cuda")
        got = kv[first:first + args.batch]
        bad = int((got != want).any(dim=1).sum().item())
        conn.send(("ok", bad))
    g.close()


def main(argv=None):
    p = argparse.ArgumentParser(prog="python3 -m mcguard.devicecheck")
    p.add_argument("--out", default="build/device-check")
    p.add_argument("--blocks", type=int, default=256)
    p.add_argument("--block-bytes", type=int, default=256 << 10)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seconds", type=float, default=8.0, help="per mode")
    args = p.parse_args(argv)
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
    endpoint, remote, decode_cuda = here.recv()
    torch.cuda.set_device(0)
    rows = []
    try:
        for mode in MODES:
            g = mcguard.Guard(cuda="required", verify=mode, notify="always")
            src = torch.empty((args.batch, args.block_bytes), dtype=torch.uint8, device="cuda")
            g.register(src)
            transfers = ok = failed = mismatches = 0
            moved = 0
            start = time.monotonic()
            seed = 1000 * MODES.index(mode)
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
                    print("  %s: %s" % (mode, e), file=sys.stderr)
                    continue
                here.send((res.id, seed, first))
                verdict, detail = here.recv()
                if verdict == "failed":
                    failed += 1
                    continue
                ok += 1
                mismatches += detail
                moved += args.batch * args.block_bytes
            seconds = time.monotonic() - start
            row = {"verify": mode, "transfers": transfers, "ok": ok, "failed": failed, "mismatches": mismatches,
                   "seconds": round(seconds, 3), "gbps": round(moved * 8 / 1e9 / seconds, 3)}
            rows.append(row)
            print("%-6s transfers %5d ok %5d failed %3d mismatches %4d  %.3f Gbit/s" % (
                mode, transfers, ok, failed, mismatches, row["gbps"]), flush=True)
            g.close()
    finally:
        here.send("stop")
        dec.join(30)
    off = next(r["gbps"] for r in rows if r["verify"] == "off") or 1e-9
    for r in rows:
        r["over_off"] = round(r["gbps"] / off, 3)
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "decode_cuda": decode_cuda,
              "batch": args.batch, "block_bytes": args.block_bytes, "modes": rows}
    with open(os.path.join(args.out, "device-check.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result))
    return 0 if all(r["mismatches"] == 0 for r in rows if r["verify"] != "off") and all(r["ok"] > 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
