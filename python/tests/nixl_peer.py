"""One side of a NIXL pull through GuardedNixlAgent, driven line by line
on stdin (the test that runs it is test_nixl.py): a producer whose blocks
are sealed, reused and rewritten on command, or a reader that READs them
and says what its state ended as and the SHA-256 of what landed. Runs in
the interpreter that has the nixl wheel; replies are JSON lines."""

import base64
import ctypes
import hashlib
import json
import mmap
import os
import sys
import threading
import time

import numpy as np

from mcguard import Guard, MCGuardError
from mcguard.nixl import GuardedNixlAgent, nixl_api

BLOCKS, BLOCK = 64, 16 << 10
SIZE = BLOCKS * BLOCK


def reply(out, **kv):
    print(json.dumps(kv), file=out, flush=True)


def main(role):
    out = os.fdopen(os.dup(1), "w")  # NIXL logs to standard output: the replies get their own
    os.dup2(2, 1)
    _, nixl_agent_config = nixl_api()
    cfg = nixl_agent_config(enable_prog_thread=role == "producer", backends=["UCX"])
    agent = GuardedNixlAgent("%s-%d" % (role, os.getpid()), cfg)
    mem = mmap.mmap(-1, SIZE)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(mem))
    agent.register_memory([(addr, SIZE, 0, "")], "DRAM")
    reply(out, meta=base64.b64encode(agent.get_agent_metadata()).decode(), addr=addr)
    blocks = [(addr + i * BLOCK, BLOCK, 0) for i in range(BLOCKS)]
    # The same blocks as one strided row, the form vLLM prepares its lists in.
    strided = agent.prep_xfer_dlist("NIXL_INIT_AGENT", strided_row(addr), "DRAM")
    churn = threading.Event()
    state = {"peer": None, "remote": None, "prepped": None}

    def churner():
        i = 0
        while churn.is_set():
            off = (i % BLOCKS) * BLOCK + (i * 997) % (BLOCK - 256)
            mem[off:off + 256] = os.urandom(256)
            i += 1

    for line in sys.stdin:
        cmd = line.split()
        try:
            if cmd[0] == "fill":  # new bytes, sealed: the seal and their hash
                mem[:] = os.urandom(SIZE)
                seal = agent.seal(blocks)
                reply(out, seal=base64.b64encode(seal).decode(), sha=hashlib.sha256(mem[:]).hexdigest())
            elif cmd[0] == "publish":  # new bytes, sealed and published under a name
                mem[:] = os.urandom(SIZE)
                agent.publish(cmd[1], blocks)
                reply(out, sha=hashlib.sha256(mem[:]).hexdigest())
            elif cmd[0] == "publish-prepped":  # publish NAME DELAY_MS: blocks of the strided list, later
                mem[:] = os.urandom(SIZE)
                sha = hashlib.sha256(mem[:]).hexdigest()
                later = threading.Timer(int(cmd[2]) / 1000, agent.publish_prepped,
                                        (cmd[1], strided, np.arange(BLOCKS)))
                later.start()
                reply(out, sha=sha)
            elif cmd[0] == "fetch":  # the producer's seal published under a name
                seal = agent.fetch_seal(state["peer"], cmd[1], timeout_ms=int(cmd[2]))
                reply(out, seal=base64.b64encode(seal).decode())
            elif cmd[0] == "seal-by-another":  # the same bytes sealed by another producer
                other = Guard(listen="127.0.0.1:0")
                other.register(addr, SIZE)
                seal = other.seal([b[0] for b in blocks], [BLOCK] * BLOCKS)
                other.close()
                reply(out, seal=base64.b64encode(seal).decode())
            elif cmd[0] == "reuse":  # the producer hands block i to another request
                i = int(cmd[1])
                mem[i * BLOCK:(i + 1) * BLOCK] = os.urandom(BLOCK)
                reply(out, ok=True)
            elif cmd[0] == "churn":
                if cmd[1] == "start":
                    churn.set()
                    threading.Thread(target=churner, daemon=True).start()
                else:
                    churn.clear()
                reply(out, ok=True)
            elif cmd[0] == "peer":  # the producer's metadata and address
                state["peer"] = agent.add_remote_agent(base64.b64decode(cmd[1]))
                state["remote"] = [(int(cmd[2]) + i * BLOCK, BLOCK, 0) for i in range(BLOCKS)]
                local = agent.prep_xfer_dlist("", agent.get_xfer_descs(blocks, "DRAM"))
                remote = agent.prep_xfer_dlist(state["peer"], agent.get_xfer_descs(state["remote"], "DRAM"))
                state["prepped"] = (local, remote)
                state["strided"] = (strided, agent.prep_xfer_dlist(state["peer"], strided_row(int(cmd[2])), "DRAM"))
                reply(out, ok=True)
            elif cmd[0] == "seal-wait":  # how long a READ named by its seal waits for it
                agent.seal_wait_ms = int(cmd[1])
                reply(out, ok=True)
            elif cmd[0] == "inject":
                agent._inject_partial = cmd[1] == "partial"
                reply(out, ok=True)
            elif cmd[0] == "read":  # read SEAL|-|name:NAME MODE prepped|strided|init
                reply(out, **read(agent, state, blocks, mem, cmd[1], cmd[2], cmd[3]))
            elif cmd[0] == "quit":
                break
        except MCGuardError as e:
            reply(out, error="%s: %s" % (e.name, e.message))
        except Exception as e:  # NIXL's own errors (a peer that went away raises)
            reply(out, state="RAISED", why="%s: %s" % (type(e).__name__, e))
    out.flush()
    os._exit(0)  # NIXL's UCX backend can crash in static destructors at exit


def strided_row(addr):
    """The blocks at addr as NIXL's strided form: one Nx5 row."""
    return np.array([[addr, BLOCK, 0, BLOCK, BLOCKS]], dtype=np.uint64)


def read(agent, state, blocks, mem, seal_arg, mode, how):
    mem[:] = bytes(SIZE)
    seal = None if seal_arg == "-" or seal_arg.startswith("name:") else base64.b64decode(seal_arg)
    name = seal_arg[5:] if seal_arg.startswith("name:") else None
    agent.mode = mode
    if how in ("prepped", "strided"):
        local, remote = state[how]
        idx = np.arange(BLOCKS)[::-1] if how == "strided" else list(range(BLOCKS))  # any order
        h = agent.make_prepped_xfer("READ", local, idx, remote, idx, seal=seal, seal_name=name)
    else:
        h = agent.initialize_xfer("READ", agent.get_xfer_descs(blocks, "DRAM"),
                                  agent.get_xfer_descs(state["remote"], "DRAM"), state["peer"], seal=seal,
                                  seal_name=name)
    st = agent.transfer(h)
    deadline = time.monotonic() + 15
    while st == "PROC" and time.monotonic() < deadline:
        st = agent.check_xfer_state(h)
    err = agent.xfer_error(h)
    res = {"state": st, "sha": hashlib.sha256(mem[:]).hexdigest(),
           "why": None if err is None else "%s: %s" % (err.name, err.message)}
    if st != "PROC":
        agent.release_xfer_handle(h)
    return res


if __name__ == "__main__":
    main(sys.argv[1])
