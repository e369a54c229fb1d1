"""The target side of Mooncake's initiator tests: a TransferEngine from
`mooncake.engine` (Mooncake's own, or mcguard's through mooncake_shim) with
one 64 MiB managed buffer, its session name printed on one line; it serves
until stdin closes.

In P2P handshake mode both engines pick their own port, so the name the
initiator needs is known only once the target runs.
"""

import sys

from mooncake.engine import TransferEngine

BUFFER = 64 << 20


def main():
    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        sys.exit("initialize failed")
    if engine.allocate_managed_buffer(BUFFER) == 0:
        sys.exit("allocate_managed_buffer failed")
    print("127.0.0.1:%d" % engine.get_rpc_port(), flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    main()
