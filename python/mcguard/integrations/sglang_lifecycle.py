"""SGLang's Mooncake KV manager wired to what keeps KV safe: the receiver's
check before a room is reported a success, quiesce before a failed
request's pages go back to the pool, and no failed write reported while
its engine calls still run.

sglang_plugin calls the wire_* functions on SGLang's modules as they load
(MC_GUARD_SGLANG=1); their files are not touched. Where SGLang does one
thing:

- prefill (MooncakeTransferEngine.batch_transfer_sync, every KV, state and
  aux write): each call is one guarded transfer; its id is kept under the
  room the transfer worker is sending (the worker's queue and executor
  say which) and the decode session it went to;
- prefill (send_kv_status_message): a room's Success carries those ids, as
  one more frame of SGLang's status message ({session: [ids]}), which a
  decoder without the plugin ignores; a Failure drops them;
- decode (parse_kv_status_message, apply_prefill_status, on the decode
  thread): a Success is applied only after the guard's sync_transfers of
  the ids for this session (notices, digests in digest mode, GPU flush); a
  failed check, or a Success with no ids, is applied as a Failure with the
  reason: SGLang's own failed-request path;
- decode (DecodeTransferQueue._release_request, where every failed,
  aborted or timed-out request's pages go back, deferred or not): the
  request's KV pages and metadata slot are quiesced first, so no late
  byte of its transfer lands in a page another request owns; with the
  decode guard keeping that quiesce, a deferred release
  (SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE) frees at once;
- over Mooncake's engine, which writes without the decode guard: that
  quiesce goes to each prefill rank the request pulls from, over SGLang's
  own ZeroMQ channel (a message its bootstrap thread takes beside ABORT),
  whose guard keeps it (mc_guard_quiesce_engine) and answers on the
  decode thread's channel; the pages go back after the answers. A failed
  write returns to SGLang only once no engine call of it still runs; the
  decode side's registration says where its guard listens (one more
  frame), for the notices.

MC_GUARD_SGLANG_QUIESCE=0 leaves quiesce out (a diagnostic: the abort
test's control shows what it protects).
"""

import collections
import importlib
import json
import logging
import secrets
import threading

from .lifecycle import check_transfers, merged, over_mooncake, settle_failed_write
from .plugin_hooks import enabled, wrap_methods

log = logging.getLogger("mcguard.sglang")

# Frames mcguard adds to SGLang's messages: the prefill's status message's
# transfer ids, the decode side's registration's guard endpoint.
IDS_FRAME = b"mcguard-transfer-ids "
GUARD_FRAME = b"mcguard-guard "
# Rooms whose ids a guard keeps at most (a room that never concludes,
# a status message never applied): the oldest go first.
MAX_ROOMS = 65536
# Over Mooncake's engine: the decode side's quiesce, sent to a prefill
# rank, and its answer; how long the decode side waits for the answers
# (the prefill's guard waits up to its sync_timeout_ms for running calls);
# how many quiesces a prefill rank keeps at once (more are refused).
QUIESCE_TAG = b"MCGUARD_QUIESCE"
QUIESCED_TAG = b"MCGUARD_QUIESCED"
QUIESCE_ANSWER_MS = 30000
MAX_QUIESCES = 8

ENGINE_METHODS = ("__init__", "batch_transfer_sync", "get_session_id")
MANAGER_METHODS = ("__init__", "transfer_worker", "send_kv_status_message", "_encode_kv_status_message",
                   "parse_kv_status_message", "apply_prefill_status", "build_receiver_registration_message",
                   "_publish_peer_registration", "_handle_abort_notification", "handle_abort_ack_message",
                   "_send_multipart_locked")
CONN_NAMES = ("MooncakeKVManager", "MooncakeKVReceiver", "KVArgsRegisterInfo", "KVPoll", "DisaggregationMode",
              "NetworkAddress")
QUEUE_METHODS = ("_release_request", "_defer_release", "_do_release")

# The room the current transfer worker thread is sending.
_room = threading.local()
# The ids one send_kv_status_message call adds to the message it encodes.
_outgoing = threading.local()
# SGLang's engine wrapper does `from mooncake.engine import TransferEngine`
# in its constructor: the name is mcguard's for that while.
_swap = threading.Lock()


def sglang_version():
    try:
        return importlib.import_module("sglang").__version__
    except (ImportError, AttributeError):
        return "unknown"


def require(module, names=(), methods=()):
    """RuntimeError naming SGLang's version where module lacks one of names
    or of methods (class, method names)."""
    missing = [n for n in names if not hasattr(module, n)]
    for cls_name, ms in methods:
        cls = getattr(module, cls_name, None)
        missing += ["%s.%s" % (cls_name, m) for m in ms if cls is None or not hasattr(cls, m)]
    if missing:
        raise RuntimeError("mcguard: SGLang %s's %s lacks %s: the plugin cannot wire the guard into this version's "
                           "PD lifecycle (unset MC_GUARD_SGLANG, or use a version README lists)"
                           % (sglang_version(), module.__name__, ", ".join(missing)))


class SentIds:
    """Guarded transfer ids by room and decode session, on the prefill side."""

    def __init__(self):
        self._mu = threading.Lock()
        self._rooms = collections.OrderedDict()

    def add(self, room, session, transfer_id):
        with self._mu:
            self._rooms.setdefault(room, {}).setdefault(session, []).append(transfer_id)
            self._rooms.move_to_end(room)
            while len(self._rooms) > MAX_ROOMS:
                self._rooms.popitem(last=False)

    def pop(self, room):
        with self._mu:
            return self._rooms.pop(room, {})


class _RoomQueue:
    """A transfer worker's queue: each chunk it hands out names the room
    the worker's writes are for."""

    def __init__(self, queue):
        self._queue = queue

    def get(self, *args, **kwargs):
        chunk = self._queue.get(*args, **kwargs)
        _room.value = getattr(chunk, "room", None)
        return chunk

    def __getattr__(self, name):
        return getattr(self._queue, name)


class _RoomExecutor:
    """A transfer worker's thread pool: the room goes with each task."""

    def __init__(self, executor):
        self._executor = executor

    def submit(self, fn, *args, **kwargs):
        room = getattr(_room, "value", None)

        def in_room():
            _room.value = room
            return fn(*args, **kwargs)
        return self._executor.submit(in_room)

    def __getattr__(self, name):
        return getattr(self._executor, name)


def wire_engine(module, replacement):
    """SGLang's MooncakeTransferEngine: its engine is replacement (a
    GuardedTransferEngine class), and each successful write's id is kept
    under the sending room; a failed write over Mooncake's engine waits for
    its engine calls."""
    require(module, ("MooncakeTransferEngine",), (("MooncakeTransferEngine", ENGINE_METHODS),))
    cls = module.MooncakeTransferEngine
    if getattr(cls, "_mcguard_wired", False):
        return

    def init(orig):
        def __init__(self, *args, **kwargs):
            with _swap:
                engine_module = importlib.import_module("mooncake.engine")
                saved = engine_module.TransferEngine
                engine_module.TransferEngine = replacement
                try:
                    orig(self, *args, **kwargs)
                finally:
                    engine_module.TransferEngine = saved
            self._mcguard_sent = SentIds()
        return __init__

    def batch_transfer_sync(orig):
        def batch_transfer_sync(self, session_id, *args, **kwargs):
            ret = orig(self, session_id, *args, **kwargs)
            if ret == 0:
                room = getattr(_room, "value", None)
                if room is not None:
                    self._mcguard_sent.add(room, session_id, self.engine.last_transfer_id)
            else:  # SGLang may free or rewrite the source, and decode its pages, once told
                settle_failed_write(self.engine, session_id)
            return ret
        return batch_transfer_sync

    wrap_methods(cls, {"__init__": init, "batch_transfer_sync": batch_transfer_sync})
    cls._mcguard_wired = True


def wire_manager(module):
    """SGLang's MooncakeKVManager and receiver: ids in the status message,
    the decode side's check before Success, the guard's endpoint in the
    registration over Mooncake's engine, the destination of each request
    kept for its quiesce."""
    require(module, CONN_NAMES, (("MooncakeKVManager", MANAGER_METHODS), ("MooncakeKVReceiver", ("send_metadata",)),
                                 ("KVArgsRegisterInfo", ("from_zmq",))))
    cls = module.MooncakeKVManager
    if getattr(cls, "_mcguard_wired", False):
        return
    poll, modes = module.KVPoll, module.DisaggregationMode

    def init(orig):
        def __init__(self, *args, **kwargs):
            orig(self, *args, **kwargs)
            guarded = getattr(self.engine, "engine", None)
            if not hasattr(guarded, "guard"):
                raise RuntimeError("mcguard: SGLang's Mooncake engine is %s, not mcguard's: the plugin's engine switch "
                                   "did not take effect" % type(guarded).__name__)
            self._mcguard_mu, self._mcguard_ids = threading.Lock(), collections.OrderedDict()
            self._mcguard_answers = Answers()
            self._mcguard_quiesces = threading.BoundedSemaphore(MAX_QUIESCES)
        return __init__

    def transfer_worker(orig):
        def transfer_worker(self, queue, executor, *args, **kwargs):
            return orig(self, _RoomQueue(queue), _RoomExecutor(executor), *args, **kwargs)
        return transfer_worker

    def send_kv_status_message(orig):
        def send_kv_status_message(self, *, targets, bootstrap_room, status, failure_reason=None):
            if self.disaggregation_mode == modes.PREFILL and status in (poll.Success, poll.Failed):
                sent = self.engine._mcguard_sent.pop(bootstrap_room)
                if status == poll.Success:
                    _outgoing.ids = sent
            try:
                return orig(self, targets=targets, bootstrap_room=bootstrap_room, status=status,
                            failure_reason=failure_reason)
            finally:
                _outgoing.ids = None
        return send_kv_status_message

    def encode(orig):
        def _encode_kv_status_message(self, **kwargs):
            parts = orig(self, **kwargs)
            sent = getattr(_outgoing, "ids", None)
            if sent is None:
                return parts
            frames = len(parts) - (self.kv_status_msg_tag is not None)
            if frames == 3:  # the reason frame, empty, so that ours is not read as one
                parts.append(b"")
            parts.append(IDS_FRAME + json.dumps(sent).encode())
            return parts
        return _encode_kv_status_message

    def parse(orig):
        def parse_kv_status_message(self, msg):
            parsed = orig(self, msg)
            if parsed is not None and self.disaggregation_mode == modes.DECODE and parsed[1] == poll.Success:
                ids = ids_for(msg, self.get_session_id())
                with self._mcguard_mu:
                    self._mcguard_ids[parsed[0]] = ids
                    while len(self._mcguard_ids) > MAX_ROOMS:
                        self._mcguard_ids.popitem(last=False)
            return parsed
        return parse_kv_status_message

    def apply(orig):
        def apply_prefill_status(self, *, bootstrap_room, status, prefill_rank, failure_reason=None):
            if self.disaggregation_mode == modes.DECODE and status == poll.Success:
                with self._mcguard_mu:
                    ids = self._mcguard_ids.pop(bootstrap_room, None)
                if bootstrap_room in self.request_status:
                    why = check_transfers(self.engine.engine.guard, ids,
                                          "is MC_GUARD_SGLANG=1 set on the prefill side?")
                    if why is not None:
                        log.error("%s; room %s fails", why, bootstrap_room)
                        status, failure_reason = poll.Failed, why
            return orig(self, bootstrap_room=bootstrap_room, status=status, prefill_rank=prefill_rank,
                        failure_reason=failure_reason)
        return apply_prefill_status

    def registration(orig):
        def build_receiver_registration_message(self):
            parts = orig(self)
            if over_mooncake(self.engine.engine):
                parts.append(GUARD_FRAME + self.engine.engine.get_guard_endpoint().encode())
            return parts
        return build_receiver_registration_message

    def publish(orig):
        def _publish_peer_registration(self, session, info, *args, **kwargs):
            endpoint = getattr(info, "mcguard_guard", None)
            if endpoint and over_mooncake(self.engine.engine):
                self.engine.engine.set_peer_guard(session, endpoint)
            return orig(self, session, info, *args, **kwargs)
        return _publish_peer_registration

    def abort_notification(orig):
        def _handle_abort_notification(self, msg):
            if msg and msg[0] == QUIESCE_TAG:
                keep_quiesce(self, msg, module.NetworkAddress)
                return True
            return orig(self, msg)
        return _handle_abort_notification

    def abort_ack(orig):
        def handle_abort_ack_message(self, msg):
            if msg and msg[0] == QUIESCED_TAG:
                if len(msg) == 3:
                    self._mcguard_answers.deliver(msg[1], msg[2].decode("utf-8", "replace"))
                return True
            return orig(self, msg)
        return handle_abort_ack_message

    wrap_methods(cls, {"__init__": init, "transfer_worker": transfer_worker,
                       "send_kv_status_message": send_kv_status_message, "_encode_kv_status_message": encode,
                       "parse_kv_status_message": parse, "apply_prefill_status": apply,
                       "build_receiver_registration_message": registration,
                       "_publish_peer_registration": publish,
                       "_handle_abort_notification": abort_notification, "handle_abort_ack_message": abort_ack})

    info_cls = module.KVArgsRegisterInfo
    from_zmq = info_cls.from_zmq.__func__

    def registered(cls_, msg):
        info = from_zmq(cls_, msg)
        for frame in msg[20:]:
            if frame.startswith(GUARD_FRAME):
                info.mcguard_guard = frame[len(GUARD_FRAME):].decode("ascii", "replace")
        return info
    info_cls.from_zmq = classmethod(registered)

    def send_metadata(orig):
        def send_metadata(self, kv_indices, aux_index=None, *args, **kwargs):
            self._mcguard_dest = ([int(i) for i in kv_indices], aux_index)
            return orig(self, kv_indices, aux_index, *args, **kwargs)
        return send_metadata

    wrap_methods(module.MooncakeKVReceiver, {"send_metadata": send_metadata})
    cls._mcguard_wired = True
    log.info("mcguard: SGLang %s's MooncakeKVManager: sync before Success, quiesce before release%s",
             sglang_version(), "" if enabled("MC_GUARD_SGLANG_QUIESCE") else " (quiesce OFF)")


def ids_for(msg, session):
    """The transfer ids a status message names for session: a list, or
    None where it carries none for it (no frame: a prefill without the
    plugin; a malformed one; ids for other sessions only)."""
    for frame in msg[3:]:
        if not frame.startswith(IDS_FRAME):
            continue
        try:
            sent = json.loads(frame[len(IDS_FRAME):])
            if not sent:
                return []
            ids = sent.get(session) if isinstance(sent, dict) else None
            if isinstance(ids, list) and all(isinstance(i, int) and 0 < i < 1 << 64 for i in ids):
                return ids
        except ValueError:
            pass
        log.error("mcguard: a status message's transfer ids name none for this session (%s): %r", session,
                  frame[:200])
        return None
    return None


def wire_decode(module):
    """SGLang's DecodeTransferQueue: quiesce before a request's pages are
    released; a deferred release at once where the decode guard keeps it."""
    require(module, ("DecodeTransferQueue",), (("DecodeTransferQueue", QUEUE_METHODS),))
    cls = module.DecodeTransferQueue
    if getattr(cls, "_mcguard_wired", False):
        return

    def release(orig):
        def _release_request(self, decode_req):
            if enabled("MC_GUARD_SGLANG_QUIESCE"):
                quiesce_request(decode_req)
            return orig(self, decode_req)
        return _release_request

    def defer(orig):
        def _defer_release(self, decode_req):
            receiver = decode_req.kv_receiver
            engine = getattr(getattr(getattr(receiver, "kv_mgr", None), "engine", None), "engine", None)
            if enabled("MC_GUARD_SGLANG_QUIESCE") and hasattr(engine, "guard") and not over_mooncake(engine):
                return self._do_release(decode_req, decode_req.metadata_buffer_index)
            return orig(self, decode_req)
        return _defer_release

    wrap_methods(cls, {"_release_request": release, "_defer_release": defer})
    cls._mcguard_wired = True


def quiesce_request(decode_req):
    """Quiesce the KV pages and metadata slot a request asked its prefill
    to write before SGLang releases them: at the decode guard, or over
    Mooncake's engine at each prefill rank it pulls from."""
    receiver = decode_req.kv_receiver
    dest = getattr(receiver, "_mcguard_dest", None)
    if dest is None:  # no destination was ever sent: nothing can be on its way
        return
    mgr = receiver.kv_mgr
    engine = mgr.engine.engine
    pages, aux = dest
    args = mgr.kv_args
    ranges = [(ptr + p * n, n) for ptr, n in zip(args.kv_data_ptrs, args.kv_item_lens) for p in pages]
    if aux is not None:
        ranges += [(ptr + aux * n, n) for ptr, n in zip(args.aux_data_ptrs, args.aux_item_lens)]
    ranges = merged(ranges)
    try:
        if over_mooncake(engine):
            quiesce_at_prefills(receiver, ranges)
        else:
            engine.guard.quiesce([a for a, _ in ranges], [n for _, n in ranges])
    except Exception as e:  # SGLang releases the pages regardless: say so loudly
        log.error("mcguard: quiesce of room %s's %d pages failed, so a late write of its can still land in a page "
                  "SGLang gives to another request: %s", receiver.bootstrap_room, len(pages), e)


def quiesce_at_prefills(receiver, ranges):
    """Send the quiesce of ranges to each prefill rank receiver pulls from
    over SGLang's channel, and wait for every answer: once they came, no
    engine call of a write begun before can land in ranges."""
    mgr = receiver.kv_mgr
    infos = list(receiver.bootstrap_infos or [])
    if not infos:
        return
    token = secrets.token_hex(16).encode()
    msg = [QUIESCE_TAG, token, mgr.get_session_id().encode(), str(mgr.local_ip).encode(), str(mgr.rank_port).encode(),
           json.dumps(ranges).encode()]
    wait = mgr._mcguard_answers.expect(token, len(infos))
    try:
        for info in infos:
            sock, lock = receiver._connect_to_bootstrap_server(info)
            with lock:
                sock.send_multipart(msg)
        errors = wait.result(QUIESCE_ANSWER_MS / 1000)
    finally:
        mgr._mcguard_answers.forget(token)
    if errors:
        raise RuntimeError("; ".join(errors))


def keep_quiesce(mgr, msg, address):
    """Prefill side: a decode rank's quiesce over Mooncake's engine, kept by
    this guard on a thread of its own (it waits for running engine calls);
    the answer goes to the decode rank's channel. address is SGLang's
    NetworkAddress."""
    try:
        _, token, session, ip, port, body = msg
        ranges = json.loads(body)
        addrs, lens = [int(a) for a, _ in ranges], [int(n) for _, n in ranges]
        to = address(ip.decode("ascii"), int(port))
        session = session.decode("ascii")
    except (ValueError, TypeError, UnicodeDecodeError) as e:
        log.error("mcguard: a malformed quiesce message (%d frames): %s", len(msg), e)
        return

    def answer(why):
        try:
            mgr._send_multipart_locked(to.to_tcp(), [QUIESCED_TAG, token, why.encode()], is_ipv6=to.is_ipv6)
        except Exception as e:  # the decode side times out and says so
            log.error("mcguard: cannot answer the quiesce of %s: %s", session, e)

    if not mgr._mcguard_quiesces.acquire(blocking=False):
        return answer("mcguard: %d quiesces are running at this prefill rank" % MAX_QUIESCES)

    def keep():
        why = ""
        try:
            mgr.engine.engine.guard.quiesce_engine(session, addrs, lens)
        except Exception as e:
            why = "mcguard: quiesce of %d ranges at %s: %s" % (len(addrs), session, e)
            log.error("%s", why)
        finally:
            mgr._mcguard_quiesces.release()
        answer(why)
    threading.Thread(target=keep, name="mcguard-quiesce", daemon=True).start()


class Answers:
    """The decode side's quiesces waiting for their prefill ranks' answers,
    by token: an answer no quiesce waits for is dropped."""

    def __init__(self):
        self._mu = threading.Lock()
        self._waits = {}

    def expect(self, token, n):
        w = _Wait(n)
        with self._mu:
            self._waits[token] = w
        return w

    def deliver(self, token, why):
        with self._mu:
            w = self._waits.get(token)
        if w is not None:
            w.add(why)

    def forget(self, token):
        with self._mu:
            self._waits.pop(token, None)


class _Wait:
    def __init__(self, n):
        self._cond, self._left, self._errors = threading.Condition(), n, []

    def add(self, why):
        with self._cond:
            self._left -= 1
            if why:
                self._errors.append(why)
            self._cond.notify_all()

    def result(self, timeout):
        """The answers' errors once all came; TimeoutError before."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._left <= 0, timeout):
                raise TimeoutError("%d prefill ranks did not answer the quiesce in %.0f s" % (self._left, timeout))
            return list(self._errors)
