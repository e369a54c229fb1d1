"""Prefill and decode in two processes, as a disaggregated server runs them.

The decode process registers its KV region and tells the prefill process
where it is; the prefill process writes 64 blocks in digest mode and sends
the transfer's id with its own "done" message (here, a pipe); the decode
process syncs that id, which compares the sender's digests with the bytes
that landed, and only then uses the blocks. Both guards share a secret, so
neither accepts a peer that does not know it.

    python3 prefill_decode.py            runs both and prints what each did

Needs mcguard importable (pip install mcguard, or PYTHONPATH=python after
make build).
"""

import ctypes
import hashlib
import json
import os
import secrets
import subprocess
import sys

from mcguard import Guard

BLOCKS, BLOCK = 64, 64 << 10
CONFIG = {"verify": "digest", "secret": os.environ.get("MC_GUARD_SECRET") or secrets.token_hex(16)}


def decode():
    """Register the KV region, say where it is, sync the announced transfer."""
    with Guard(CONFIG) as g:
        kv = g.alloc(BLOCKS * BLOCK)
        print(json.dumps({"endpoint": g.endpoint, "kv": kv}), flush=True)
        transfer_id = int(sys.stdin.readline())
        g.sync_transfers([transfer_id])  # raises MCGuardError unless the bytes are the sender's
        landed = hashlib.sha256(ctypes.string_at(kv, BLOCKS * BLOCK)).hexdigest()
        print(json.dumps({"sha256": landed}), flush=True)


def prefill(endpoint, remote_kv):
    """Write every block; the id goes to decode with the "done" message."""
    with Guard(CONFIG) as g:
        kv = g.alloc(BLOCKS * BLOCK)
        payload = os.urandom(BLOCKS * BLOCK)
        ctypes.memmove(kv, payload, len(payload))
        result = g.transfer(endpoint, [kv + i * BLOCK for i in range(BLOCKS)],
                            [remote_kv + i * BLOCK for i in range(BLOCKS)], [BLOCK] * BLOCKS)
        return result.id, hashlib.sha256(payload).hexdigest()


def main():
    # The decode side in its own process, given the same secret.
    env = dict(os.environ, MC_GUARD_SECRET=CONFIG["secret"])
    dec = subprocess.Popen([sys.executable, __file__, "decode"], env=env, text=True,
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    hello = json.loads(dec.stdout.readline())
    transfer_id, sent = prefill(hello["endpoint"], hello["kv"])
    print("prefill: wrote %d x %d KiB to %s, transfer %d" % (BLOCKS, BLOCK >> 10, hello["endpoint"], transfer_id))
    dec.stdin.write("%d\n" % transfer_id)
    dec.stdin.close()
    landed = json.loads(dec.stdout.readline())["sha256"]
    if dec.wait() != 0:
        sys.exit("decode failed")
    print("decode : synced transfer %d; sha256 of its KV %s" % (transfer_id, landed[:16]))
    print("result : %s" % ("the bytes decode holds are the bytes prefill sent" if landed == sent
                           else "MISMATCH after a successful sync"))
    return 0 if landed == sent else 1


if __name__ == "__main__":
    if sys.argv[1:] == ["decode"]:
        decode()
    else:
        sys.exit(main())
