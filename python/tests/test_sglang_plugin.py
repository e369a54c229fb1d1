"""The SGLang general plugin and its lifecycle wiring's parts: with
MC_GUARD_SGLANG=1 SGLang's Mooncake engine wrapper constructs mcguard's
engine; a module of a shape it does not know fails naming SGLang's
version; the status message's ids frame. Tested on stand-in modules here,
and on SGLang's own where sglang is importable."""

import subprocess
import sys
import textwrap
import types

import pytest

from mcguard.integrations import sglang_lifecycle

PLUGIN_CHECK = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {tmp!r})
    os.environ["MC_GUARD_SGLANG"] = {flag!r}
    from mcguard.integrations import sglang_plugin
    sglang_plugin.ENGINE_MODULE = "fake_engine"
    sglang_plugin.register()
    import fake_engine
    e = fake_engine.MooncakeTransferEngine()
    print(type(e.engine).__name__, fake_engine.MooncakeTransferEngine._mcguard_wired)
""")

# What SGLang's wrapper does: the import inside its constructor.
FAKE_ENGINE = textwrap.dedent("""
    class MooncakeTransferEngine:
        _mcguard_wired = False

        def __init__(self):
            from mooncake.engine import TransferEngine
            self.engine = TransferEngine()

        def batch_transfer_sync(self, session_id, buffers, peer_buffer_addresses, lengths):
            return self.engine.batch_transfer_sync_write(session_id, buffers, peer_buffer_addresses, lengths)

        def get_session_id(self):
            return "127.0.0.1:1"
""")


def run_check(tmp_path, flag):
    (tmp_path / "fake_engine.py").write_text(FAKE_ENGINE)
    return subprocess.run([sys.executable, "-c", PLUGIN_CHECK.format(tmp=str(tmp_path), flag=flag)],
                          capture_output=True, text=True, timeout=60)


def test_the_plugin_switches_the_engine_sglang_constructs(tmp_path):
    p = run_check(tmp_path, "1")
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["GuardedTransferEngine", "True"]


def test_without_the_flag_the_plugin_does_nothing(tmp_path):
    p = run_check(tmp_path, "0")
    # SGLang's own engine (Mooncake's) where it is installed, else its ImportError.
    assert ("GuardedTransferEngine" not in p.stdout) and (p.returncode == 0 or "mooncake" in p.stderr), p


def test_a_module_of_another_shape_fails_naming_the_version():
    for wire in (sglang_lifecycle.wire_manager, sglang_lifecycle.wire_decode,
                 lambda m: sglang_lifecycle.wire_engine(m, object)):
        with pytest.raises(RuntimeError, match=r"SGLang .*'s not_sglang lacks .*unset MC_GUARD_SGLANG"):
            wire(types.ModuleType("not_sglang"))


def frames(ids_frame):
    return [b"7", b"4", b"0", b"", ids_frame]


def test_the_status_messages_ids_are_read_for_this_session_only():
    ids_for = sglang_lifecycle.ids_for
    frame = sglang_lifecycle.IDS_FRAME
    assert ids_for(frames(frame + b'{"10.0.0.1:5": [17, 18], "10.0.0.2:5": [3]}'), "10.0.0.1:5") == [17, 18]
    assert ids_for(frames(frame + b"{}"), "10.0.0.1:5") == [], "a room that wrote nothing"
    assert ids_for([b"7", b"4", b"0"], "10.0.0.1:5") is None, "a prefill without the plugin"
    for bad in (b'{"10.0.0.2:5": [3]}', b"not json", b'{"10.0.0.1:5": [-1]}', b'{"10.0.0.1:5": [18446744073709551616]}',
                b'{"10.0.0.1:5": ["17"]}', b"[1, 2]"):
        assert ids_for(frames(frame + bad), "10.0.0.1:5") is None, bad


def test_the_prefills_ids_are_bounded_by_room(monkeypatch):
    monkeypatch.setattr(sglang_lifecycle, "MAX_ROOMS", 3)
    sent = sglang_lifecycle.SentIds()
    for room in range(5):
        sent.add(room, "s", room + 100)
    sent.add(4, "t", 7)
    assert sent.pop(0) == {} and sent.pop(1) == {}, "the oldest rooms went first"
    assert sent.pop(4) == {"s": [104], "t": [7]} and sent.pop(4) == {}


def test_on_sglangs_own_modules():
    try:
        import sglang  # noqa: F401
    except ImportError:
        pytest.skip("sglang is not installed in this interpreter: make test-sglang runs this in its environment")
    code = textwrap.dedent("""
        import os; os.environ["MC_GUARD_SGLANG"] = "1"
        from mcguard.integrations import sglang_plugin
        sglang_plugin.register()
        import importlib
        from sglang.srt.distributed.device_communicators import mooncake_transfer_engine as e
        from sglang.srt.disaggregation.mooncake import conn
        from sglang.srt.disaggregation import decode
        print(e.MooncakeTransferEngine._mcguard_wired, conn.MooncakeKVManager._mcguard_wired,
              decode.DecodeTransferQueue._mcguard_wired)
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    assert p.stdout.split()[-3:] == ["True", "True", "True"], p.stdout


class FakeAddress:
    def __init__(self, host, port):
        self.host, self.port, self.is_ipv6 = host, port, False

    def to_tcp(self):
        return "tcp://%s:%d" % (self.host, self.port)


class FakePrefill:
    """What keep_quiesce uses of a prefill rank's manager."""

    def __init__(self, fail=None):
        import threading
        self.sent, self.kept, self.fail = [], [], fail
        self._mcguard_quiesces = threading.BoundedSemaphore(sglang_lifecycle.MAX_QUIESCES)
        guard = types.SimpleNamespace(quiesce_engine=self.quiesce_engine)
        self.engine = types.SimpleNamespace(engine=types.SimpleNamespace(guard=guard))

    def quiesce_engine(self, session, addrs, lens):
        if self.fail:
            raise RuntimeError(self.fail)
        self.kept.append((session, addrs, lens))

    def _send_multipart_locked(self, endpoint, parts, is_ipv6=False):
        self.sent.append((endpoint, parts))


def quiesce_msg(body=b"[[4096, 8192], [65536, 4096]]"):
    return [sglang_lifecycle.QUIESCE_TAG, b"tok", b"10.0.0.1:5", b"10.0.0.1", b"7000", body]


def wait_for(cond):
    import time
    deadline = time.monotonic() + 5
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return cond()


def test_a_prefill_rank_keeps_a_quiesce_and_answers():
    mgr = FakePrefill()
    sglang_lifecycle.keep_quiesce(mgr, quiesce_msg(), FakeAddress)
    assert wait_for(lambda: mgr.sent)
    assert mgr.kept == [("10.0.0.1:5", [4096, 65536], [8192, 4096])]
    assert mgr.sent == [("tcp://10.0.0.1:7000", [sglang_lifecycle.QUIESCED_TAG, b"tok", b""])]


def test_a_quiesce_that_fails_is_answered_with_why():
    mgr = FakePrefill(fail="engine calls still running")
    sglang_lifecycle.keep_quiesce(mgr, quiesce_msg(), FakeAddress)
    assert wait_for(lambda: mgr.sent)
    assert b"engine calls still running" in mgr.sent[0][1][2]


def test_a_malformed_quiesce_is_dropped_not_raised():
    for msg in (quiesce_msg(b"not json"), quiesce_msg(b"[[1]]"), quiesce_msg()[:4],
                quiesce_msg()[:4] + [b"port", b"[]"]):
        mgr = FakePrefill()
        sglang_lifecycle.keep_quiesce(mgr, msg, FakeAddress)
        assert mgr.sent == [] and mgr.kept == [], msg


def test_the_decode_side_waits_for_every_answer_and_no_longer():
    answers = sglang_lifecycle.Answers()
    w = answers.expect(b"t", 2)
    answers.deliver(b"t", "")
    answers.deliver(b"other", "nobody waits for this")
    with pytest.raises(TimeoutError, match="1 prefill ranks did not answer"):
        w.result(0.05)
    answers.deliver(b"t", "refused")
    assert w.result(0.05) == ["refused"]
    answers.forget(b"t")
    answers.deliver(b"t", "late")  # dropped
