"""A receiving guard in its own process, for the fault tests.

    python3 peer.py '{"listen": "...", ...}' SIZE [alloc]

(alloc: the region comes from Guard.alloc, a shared allocation a
same-host sender maps, instead of memory registered.)

Prints one JSON line {"endpoint": ..., "addr": ...}, then answers commands
on stdin: "hash" prints the SHA-1 of the region (after a sync), "synced
ID..." syncs those transfers (sync_transfers) and prints "ok" or the
error, "quit" exits.
"""

import ctypes
import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import mcguard  # noqa: E402


def main():
    cfg, size = json.loads(sys.argv[1]), int(sys.argv[2])
    g = mcguard.Guard(cfg)
    if sys.argv[3:] == ["alloc"]:
        addr = g.alloc(size)
    else:
        buf = ctypes.create_string_buffer(size)
        addr = ctypes.addressof(buf)
        g.register(addr, size)
    print(json.dumps({"endpoint": g.endpoint, "addr": addr}), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "hash":
            g.sync([addr], [size])
            print(hashlib.sha1(ctypes.string_at(addr, size)).hexdigest(), flush=True)
        elif cmd.startswith("synced "):
            try:
                g.sync_transfers([int(x) for x in cmd.split()[1:]])
                print("ok", flush=True)
            except mcguard.MCGuardError as e:
                print("error %s" % str(e).replace("\n", " "), flush=True)
        elif cmd == "quit":
            break
    g.close()


if __name__ == "__main__":
    main()
