"""Mooncake's TransferEngine API used as its documentation describes, in one
script that runs on Mooncake itself and on GuardedTransferEngine, printing
each call's result as JSON so the two can be compared.

    python3 mooncake_conventions.py mooncake|mcguard

Both engines live in this process (two engines, one each side), as in
Mooncake's own examples.
"""

import json
import sys
import time


def engine_module(which):
    if which == "mooncake":
        import mooncake.engine as m
        return m.TransferEngine, m.TransferOpcode, m.TransferNotify
    from mcguard.mooncake import GuardedTransferEngine, TransferNotify, TransferOpcode
    return GuardedTransferEngine, TransferOpcode, TransferNotify


def main():
    TransferEngine, TransferOpcode, TransferNotify = engine_module(sys.argv[1])
    out = {}
    a, b = TransferEngine(), TransferEngine()
    out["initialize"] = [a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", ""),
                         b.initialize_ext("127.0.0.1", "P2PHANDSHAKE", "tcp", "", "p2p")]
    session = "127.0.0.1:%d" % b.get_rpc_port()
    size = 1 << 20
    src, dst = a.allocate_managed_buffer(size), b.allocate_managed_buffer(size)
    out["allocate_nonzero"] = [src != 0, dst != 0]
    payload = bytes(range(256)) * 16
    out["write_bytes"] = a.write_bytes_to_buffer(src, payload, len(payload))
    out["read_bytes_back"] = a.read_bytes_from_buffer(src, len(payload)) == payload
    out["first_buffer_nonzero"] = a.get_first_buffer_address(session) != 0
    out["transfer_sync_write"] = a.transfer_sync(session, src, dst, len(payload), TransferOpcode.Write,
                                                 TransferNotify("req-1", "done"))
    out["landed"] = b.read_bytes_from_buffer(dst, len(payload)) == payload
    deadline = time.monotonic() + 10
    notes = []
    while not notes and time.monotonic() < deadline:  # Mooncake delivers notifies asynchronously
        notes = [(n.name, n.msg) for n in b.get_notifies()]
        time.sleep(0.01)
    out["notifies"] = notes
    out["notifies_again"] = [(n.name, n.msg) for n in b.get_notifies()]
    out["sync_write"] = a.transfer_sync_write(session, src, dst + 4096, 4096)
    out["sync_read"] = a.transfer_sync_read(session, src + 8192, dst, 4096)
    out["read_matches"] = a.read_bytes_from_buffer(src + 8192, 4096) == payload[:4096]
    out["batch_sync_read"] = a.batch_transfer_sync(session, [src], [dst], [4096], TransferOpcode.Read)
    ids = [a.batch_transfer_async_write(session, [src + i * 4096], [dst + i * 4096], [4096]) for i in range(3)]
    out["async_ids_positive"] = all(isinstance(i, int) and i > 0 for i in ids)
    out["batch_status"] = a.get_batch_transfer_status(ids)
    out["async_read"] = a.get_batch_transfer_status([a.batch_transfer_async(session, [src], [dst], [4096],
                                                                            TransferOpcode.Read)])
    out["async_mismatched"] = a.batch_transfer_async_write(session, [src], [dst], [1, 2])
    bid = a.transfer_submit_write(session, src, dst, 4096)
    status, deadline = 0, time.monotonic() + 10
    while status == 0 and time.monotonic() < deadline:
        status = a.transfer_check_status(bid)
    out["check_status"] = status
    out["send_probe"] = a.send_probe(session)
    # A peer nobody registered: the async calls return the failure sentinel 0
    # at once, and the probe fails without raising.
    out["async_unknown_peer"] = a.batch_transfer_async_write("unreachable_peer:9", [0], [0], [16])
    out["submit_unknown_peer"] = a.transfer_submit_write("unreachable_peer:9", 0, 0, 16)
    out["probe_unknown_peer_fails"] = a.send_probe("unreachable_peer:9") != 0
    out["warmup_efa_segment"] = a.warmup_efa_segment(session)
    topo = json.loads(a.get_local_topology())
    out["topology_shape"] = sorted(topo) and all(len(v) == 2 for v in topo.values())
    out["opcodes"] = [int(TransferOpcode.Read), int(TransferOpcode.Write)]
    out["free"] = [a.free_managed_buffer(src, size), b.free_managed_buffer(dst, size)]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
