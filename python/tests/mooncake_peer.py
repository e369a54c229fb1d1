"""A decode-side GuardedTransferEngine in its own process, used the way
Mooncake's documentation uses a TransferEngine.

    python3 mooncake_peer.py SIZE

Prints one JSON line {"session": ..., "addr": ...} for a managed buffer of
SIZE bytes, then answers commands on stdin, one line each:
"fill" writes random bytes into the buffer and prints their SHA-1;
"hash" checks what landed (sync) and prints the buffer's SHA-1;
"notifies" prints get_notifies() as a JSON list of [name, msg];
"quit" exits.
"""

import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mcguard.mooncake import GuardedTransferEngine  # noqa: E402


def main():
    size = int(sys.argv[1])
    engine = GuardedTransferEngine()
    if engine.initialize_ext("127.0.0.1", "P2PHANDSHAKE", "tcp", "", "p2p") != 0:
        sys.exit("initialize_ext failed")
    addr = engine.allocate_managed_buffer(size)
    if addr == 0:
        sys.exit("allocate_managed_buffer failed")
    print(json.dumps({"session": "127.0.0.1:%d" % engine.get_rpc_port(), "addr": addr}), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "fill":
            data = os.urandom(size)
            assert engine.write_bytes_to_buffer(addr, data, size) == 0
            print(hashlib.sha1(data).hexdigest(), flush=True)
        elif cmd == "hash":
            assert engine.sync([addr], [size]) == 0
            print(hashlib.sha1(engine.read_bytes_from_buffer(addr, size)).hexdigest(), flush=True)
        elif cmd == "notifies":
            print(json.dumps([[n.name, n.msg] for n in engine.get_notifies()]), flush=True)
        elif cmd == "quit":
            break
    assert engine.free_managed_buffer(addr, size) == 0
    engine.close()


if __name__ == "__main__":
    main()
