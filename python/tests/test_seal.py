"""Verified reads through the Python binding: a producer seals its
blocks, a reader's read succeeds only with the sealed bytes. Every
success compares the reader's bytes with the producer's."""

import hashlib
import os

import pytest

from mcguard import MCGuardError
from conftest import Buf

N, SIZE = 8, 16 << 10


def h(b):
    return hashlib.sha256(b).hexdigest()


@pytest.fixture
def producer_reader(guards):
    def make(cfg=None):
        producer, reader = guards(**(cfg or {})), guards(**(cfg or {}))
        kv, into = Buf(N * SIZE, os.urandom(N * SIZE)), Buf(N * SIZE)
        producer.register(kv.addr, N * SIZE)
        reader.register(into.addr, N * SIZE)
        remote = [kv.addr + i * SIZE for i in range(N)]
        local = [into.addr + i * SIZE for i in range(N)]
        return producer, reader, kv, into, remote, local
    return make


@pytest.mark.parametrize("mode", [None, "digest", "tail"])
def test_sealed_read_returns_the_producers_bytes(producer_reader, mode):
    producer, reader, kv, into, remote, local = producer_reader()
    seal = producer.seal(remote, [SIZE] * N)
    assert isinstance(seal, bytes) and len(seal) <= 40 + 40 * N + 32
    reader.read_sealed(producer.endpoint, local, remote, [SIZE] * N, seal, mode=mode)
    assert h(into.bytes()) == h(kv.bytes())
    assert reader.stats()["seals_checked"] == 1


def test_a_block_reused_after_sealing_fails_the_read(producer_reader):
    producer, reader, kv, into, remote, local = producer_reader()
    seal = producer.seal(remote, [SIZE] * N)
    kv.write(3 * SIZE, os.urandom(SIZE))  # the producer hands block 3 to another request
    with pytest.raises(MCGuardError) as e:
        reader.read_sealed(producer.endpoint, local, remote, [SIZE] * N, seal)
    assert e.value.name == "MC_ERR_VERIFY" and "[3]" in e.value.message
    assert reader.stats()["seal_mismatches"] == 1


def test_some_sealed_blocks_read_apart_are_matched_by_address(producer_reader):
    producer, reader, kv, into, remote, local = producer_reader()
    seal = producer.seal(remote, [SIZE] * N)
    reader.read_sealed(producer.endpoint, local[::-1][:3], remote[::-1][:3], [SIZE] * 3, seal)
    reader.read_sealed(producer.endpoint, local[:N - 3], remote[:N - 3], [SIZE] * (N - 3), seal, mode="tail")
    assert h(into.bytes()) == h(kv.bytes())


def test_check_seal_after_another_engines_read(producer_reader):
    producer, reader, kv, into, remote, local = producer_reader()
    seal = producer.seal(remote, [SIZE] * N)
    into.write(0, kv.bytes())  # what another engine's read landed
    reader.check_seal(local, [SIZE] * N, seal, remote=remote, producer=producer.id)
    reader.check_seal(local, [SIZE] * N, seal, mode="tail")
    assert len(producer.id) == 16 and producer.id != reader.id
    with pytest.raises(MCGuardError) as e:
        reader.check_seal(local, [SIZE] * N, seal, producer=reader.id)
    assert e.value.name == "MC_ERR_SEAL"
    into.write(5 * SIZE + 100, b"x")
    with pytest.raises(MCGuardError) as e:
        reader.check_seal(local, [SIZE] * N, seal)
    assert e.value.name == "MC_ERR_VERIFY" and "[5]" in e.value.message


def test_forged_and_foreign_seals_are_refused_where_guards_share_a_secret(producer_reader, guards):
    secret = {"secret": "correct horse battery staple"}
    producer, reader, kv, into, remote, local = producer_reader(secret)
    seal = producer.seal(remote, [SIZE] * N)
    forged = bytearray(seal)
    forged[56] ^= 1  # range 0's digest
    unsigned = guards().seal  # a guard without the secret seals the same memory
    plain = guards()
    plain.register(kv.addr, N * SIZE)
    for bad in (bytes(forged), seal[:-1], plain.seal(remote, [SIZE] * N), b"MCS1" + bytes(100)):
        with pytest.raises(MCGuardError) as e:
            reader.read_sealed(producer.endpoint, local, remote, [SIZE] * N, bad)
        assert e.value.name == "MC_ERR_SEAL", bad[:8]
    del unsigned
    reader.read_sealed(producer.endpoint, local, remote, [SIZE] * N, seal)
    assert h(into.bytes()) == h(kv.bytes())


@pytest.mark.parametrize("call, status", [
    (lambda p, r, s, rem, loc: r.read_sealed(p.endpoint, loc, rem, [SIZE] * N, "a str"), "MC_ERR_INVALID_ARG"),
    (lambda p, r, s, rem, loc: r.read_sealed(p.endpoint, loc, rem, [SIZE] * N, b""), "MC_ERR_INVALID_ARG"),
    (lambda p, r, s, rem, loc: r.read_sealed(p.endpoint, loc, rem, [SIZE] * N, s, mode="sample"), "MC_ERR_INVALID_ARG"),
    (lambda p, r, s, rem, loc: r.check_seal(loc[:2], [SIZE] * 2, s), "MC_ERR_SEAL"),
    (lambda p, r, s, rem, loc: r.read_sealed(p.endpoint, loc, rem, [SIZE - 1] + [SIZE] * (N - 1), s), "MC_ERR_SEAL"),
    (lambda p, r, s, rem, loc: r.check_seal(loc, [SIZE] * N, s, producer=b"short"), "MC_ERR_INVALID_ARG"),
    (lambda p, r, s, rem, loc: r.check_seal(loc, [SIZE] * N, s, remote=rem[:1]), "MC_ERR_INVALID_ARG"),
    (lambda p, r, s, rem, loc: r.check_seal(loc, [SIZE] * N, s, remote=[a + 1 for a in rem]), "MC_ERR_SEAL"),
    (lambda p, r, s, rem, loc: p.seal([], []), "MC_ERR_INVALID_ARG"),
    (lambda p, r, s, rem, loc: p.seal([2 ** 64], [1]), "MC_ERR_INVALID_ARG"),
    (lambda p, r, s, rem, loc: p.seal(loc, [SIZE] * N), "MC_ERR_NOT_REGISTERED"),
    (lambda p, r, s, rem, loc: p.seal(rem, [0] * N), "MC_ERR_INVALID_ARG"),
])
def test_bad_input_gets_a_clear_status(producer_reader, call, status):
    producer, reader, kv, into, remote, local = producer_reader()
    seal = producer.seal(remote, [SIZE] * N)
    with pytest.raises(MCGuardError) as e:
        call(producer, reader, seal, remote, local)
    assert e.value.name == status, e.value.message


def test_a_published_seal_is_fetched_by_name(producer_reader):
    producer, reader, kv, into, remote, local = producer_reader()
    producer.publish("req-7", remote, [SIZE] * N)
    seal = reader.fetch_seal(producer.endpoint, "req-7", timeout_ms=2000)
    reader.read_sealed(producer.endpoint, local, remote, [SIZE] * N, seal)
    assert h(into.bytes()) == h(kv.bytes())
    producer.withdraw("req-7")
    with pytest.raises(MCGuardError) as e:
        reader.fetch_seal(producer.endpoint, "req-7", timeout_ms=50)
    assert e.value.name == "MC_ERR_TIMEOUT"
    for bad in (None, 7, "a\0b", ""):
        with pytest.raises(MCGuardError) as e:
            producer.publish(bad, remote, [SIZE] * N)
        assert e.value.name == "MC_ERR_INVALID_ARG"
    with pytest.raises(MCGuardError) as e:
        reader.fetch_seal(producer.endpoint, "req-7", timeout_ms=-1)
    assert e.value.name == "MC_ERR_INVALID_ARG"
    with pytest.raises(MCGuardError) as e:
        producer.withdraw("req-7")
    assert e.value.name == "MC_ERR_INVALID_ARG"
