"""Verified pulls over NIXL's real wheel (nixl-cu12, UCX backend, host
memory; make nixl-venv installs it into build/venv-mooncake): a producer
and a reader process, each a GuardedNixlAgent. A READ ends "DONE" only
with the sealed bytes, hashed on the reader's side; a producer that reuses
or rewrites its blocks, a partial read, a seal that is forged or from
another producer, and a dead producer end it "ERR" (or not DONE), never
"DONE" with other bytes."""

import base64
import json
import os
import signal
import subprocess

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
NIXL_PYTHON = os.environ.get("MCGUARD_NIXL_PYTHON", os.path.join(ROOT, "build", "venv-mooncake", "bin", "python"))
SECRET = "nixl pulls are checked"


def nixl_python():
    if not os.path.exists(NIXL_PYTHON) or subprocess.run(
            [NIXL_PYTHON, "-c", "import nixl_cu12"], capture_output=True).returncode != 0:
        pytest.skip("NIXL's wheel is not installed here (make nixl-venv installs it; make test does)")
    return NIXL_PYTHON


class Peer:
    """A nixl_peer.py process: send a command line, read its JSON reply."""

    def __init__(self, role, **env):
        self.proc = subprocess.Popen(
            [nixl_python(), os.path.join(HERE, "nixl_peer.py"), role], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            env=dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"), UCX_TLS="tcp", MC_GUARD_SECRET=SECRET,
                     **env))
        self.hello = self.reply()

    def reply(self):
        line = self.proc.stdout.readline()
        assert line, "the %s peer exited (status %s)" % (self, self.proc.poll())
        return json.loads(line)

    def __call__(self, *words):
        self.proc.stdin.write(" ".join(str(w) for w in words) + "\n")
        self.proc.stdin.flush()
        return self.reply()

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=20)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()


@pytest.fixture
def pull():
    producer, reader = Peer("producer"), Peer("reader")
    assert reader("peer", producer.hello["meta"], producer.hello["addr"]) == {"ok": True}
    yield producer, reader
    reader.close()
    producer.close()


@pytest.mark.parametrize("mode", ["digest", "tail"])
@pytest.mark.parametrize("how", ["prepped", "init"])
def test_an_honest_read_is_done_with_the_sealed_bytes(pull, mode, how):
    producer, reader = pull
    sealed = producer("fill")
    got = reader("read", sealed["seal"], mode, how)
    assert got["state"] == "DONE", got
    assert got["sha"] == sealed["sha"]


def test_a_seal_published_by_the_producer_is_fetched_by_the_reader(pull):
    producer, reader = pull
    assert "error" in reader("fetch", "req-1", 100), "nothing published yet: the fetch times out"
    published = producer("publish", "req-1")
    fetched = reader("fetch", "req-1", 5000)
    got = reader("read", fetched["seal"], "digest", "prepped")
    assert got["state"] == "DONE" and got["sha"] == published["sha"], got


@pytest.mark.parametrize("mode", ["digest", "tail"])
def test_a_read_named_by_its_seal_waits_for_the_publication_then_checks(pull, mode):
    """vLLM's way: the reader posts the READ naming the seal, and the
    producer publishes it (sealing its strided list by descriptor index)
    after the READ began; the READ is DONE only once the seal came."""
    producer, reader = pull
    published = producer("publish-prepped", "req-7", 300)
    got = reader("read", "name:req-7", mode, "strided")
    assert got["state"] == "DONE" and got["sha"] == published["sha"], got
    producer("reuse", 5)
    got = reader("read", "name:req-7", mode, "strided")
    assert got["state"] == "ERR" and "MC_ERR_VERIFY" in got["why"], got


def test_a_read_named_by_a_seal_never_published_fails(pull):
    producer, reader = pull
    producer("fill")
    reader("seal-wait", 300)
    got = reader("read", "name:never", "digest", "strided")
    assert got["state"] == "ERR" and "the READ's seal" in got["why"], got


@pytest.mark.parametrize("mode", ["digest", "tail"])
def test_a_block_reused_before_the_read_fails_it(pull, mode):
    producer, reader = pull
    sealed = producer("fill")
    producer("reuse", 9)
    got = reader("read", sealed["seal"], mode, "prepped")
    assert got["state"] == "ERR" and "MC_ERR_VERIFY" in got["why"] and "[9]" in got["why"], got


def test_a_producer_rewriting_its_blocks_mid_read_never_gives_done_with_other_bytes(pull):
    producer, reader = pull
    sealed = producer("fill")
    producer("churn", "start")
    states = []
    for _ in range(20):
        got = reader("read", sealed["seal"], "digest", "prepped")
        assert got["state"] != "DONE" or got["sha"] == sealed["sha"], "DONE with bytes other than the sealed ones"
        states.append(got["state"])
    producer("churn", "stop")
    assert "ERR" in states, states


def test_a_partial_read_fails(pull):
    producer, reader = pull
    sealed = producer("fill")
    reader("inject", "partial")
    for mode in ("digest", "tail"):
        got = reader("read", sealed["seal"], mode, "init")
        assert got["state"] == "ERR" and "MC_ERR_VERIFY" in got["why"] and "[63]" in got["why"], got
    reader("inject", "none")
    assert reader("read", sealed["seal"], "digest", "init")["state"] == "DONE"


def test_bad_seals_and_no_seal_fail_the_read(pull):
    producer, reader = pull
    sealed = producer("fill")
    raw = bytearray(base64.b64decode(sealed["seal"]))
    raw[56] ^= 1  # range 0's digest, under the MAC
    cases = {"forged": base64.b64encode(bytes(raw)).decode(),
             "truncated": base64.b64encode(bytes(raw[:-1])).decode(),
             "another producer": producer("seal-by-another")["seal"],
             "none": "-"}
    for name, seal in cases.items():
        got = reader("read", seal, "digest", "prepped")
        assert got["state"] == "ERR" and "MC_ERR_SEAL" in got["why"], (name, got)


def test_a_dead_producer_never_gives_done(pull):
    producer, reader = pull
    sealed = producer("fill")
    producer.proc.send_signal(signal.SIGKILL)
    producer.proc.wait()
    got = reader("read", sealed["seal"], "digest", "prepped")
    assert got["state"] != "DONE", got
