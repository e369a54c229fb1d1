"""make bench-peer's tool runs end to end (tiny settings): every engine's
destination is hashed at the receiver and the summary has every cell."""

import os
import subprocess

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
VENV_PYTHON = os.path.join(ROOT, "build", "venv-mooncake", "bin", "python")


def test_peerbench_runs_and_checks_every_destination():
    if not os.path.exists(VENV_PYTHON):
        pytest.skip("no Mooncake wheel here (make mooncake-venv installs it into build/venv-mooncake)")
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    out = subprocess.run([VENV_PYTHON, "-m", "mcguard.tools.peerbench", "--rounds", "1", "--latency-iters", "5",
                          "--seconds", "0.05", "--sizes", "1x4KiB", "512x16KiB",
                          "--engines", "mooncake", "mcguard-off", "mcguard-tail", "mcguard-digest", "socket",
                          "mcguard-socket-digest+sync", "mcguard-socket-off+ping"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert "every destination matched its source" in out.stdout
    summary, _, profiled = out.stdout.partition("Where the time went:")
    rows = {line.split()[0]: line for line in summary.splitlines() if line and line.split()[0] in
            ("mooncake", "mcguard-off", "mcguard-tail", "mcguard-digest", "socket", "mcguard-socket-digest+sync",
             "mcguard-socket-off+ping")}
    assert set(rows) == {"mooncake", "mcguard-off", "mcguard-tail", "mcguard-digest", "socket",
                         "mcguard-socket-digest+sync", "mcguard-socket-off+ping"}
    assert "(x" in rows["mcguard-tail"], "ratios to Mooncake in the same run"
    cols = {tuple(line.split()[:2]): line.split()[2:] for line in profiled.splitlines() if len(line.split()) == 10}
    for kind in rows:
        for shape in ("1x4KiB", "512x16KiB"):
            cells = cols[(kind, shape)]
            if kind in ("mooncake", "socket"):
                assert cells[0] != "-" and set(cells[1:]) == {"-"}, "no guard, no library time: " + str(cells)
                continue
            whole, library, engine, checks, own, outside, call, sync = cells
            assert engine == "-", "mcguard's own planes call no engine"
            assert 0 < float(library) <= float(whole) * 1.01, "the library's time is part of the transfer's"
            assert abs(float(library) - float(checks) - float(own)) < 0.2, "the checks and the rest make it up"
            assert (sync != "-") == ("+sync" in kind), "the receiver's sync calls are timed where there are some"
            assert (call != "-") == ("+sync" in kind or "+ping" in kind), "the receiver's call, where it is asked"
            assert "+sync" not in kind or float(call) >= float(sync), "the call as its process timed it holds the sync"
    assert out.stderr.count("round 1/1") == 14, "a progress line per measurement"
    progress = [line for line in out.stderr.splitlines() if line.startswith("round 1/1")]
    for line in progress:
        ours = line.split()[3].startswith("mcguard-")
        assert ("busy poll: sender" in line and "receiver" in line) == ours, \
            "mcguard's progress lines say how its busy polling went, and only theirs: " + line
    synced = [line for line in progress if "digest+sync" in line or "+ping" in line]
    assert len(synced) == 4 and all("the receiver's call: median" in line for line in synced), \
        "the receiver's sync (or nothing, for +ping) is timed where it runs, and the pipe to it is named as left out"


def test_scattered_layout_is_a_fixed_shuffle_and_its_hash_follows_it():
    from mcguard.tools.peerbench import dest_slots, landed_hash
    slots = dest_slots(512, True)
    assert sorted(slots) == list(range(512)) and slots != list(range(512))
    dest_slots.cache_clear()
    assert slots == dest_slots(512, True), "the same shuffle every run (made again, not cached)"
    assert dest_slots(512, False) == list(range(512))
    src = os.urandom(4 * 16)
    landed = bytearray(4 * 16)
    order = [2, 0, 3, 1]
    for i, j in enumerate(order):
        landed[j * 16:(j + 1) * 16] = src[i * 16:(i + 1) * 16]
    import hashlib
    assert landed_hash(lambda off, n: src[off:off + n], 4, 16, order) == hashlib.sha1(landed).hexdigest()
    assert landed_hash(lambda off, n: src[off:off + n], 4, 16, [0, 1, 2, 3]) == hashlib.sha1(src).hexdigest()


def test_peerbench_scattered_layout_checks_every_destination():
    if not os.path.exists(VENV_PYTHON):
        pytest.skip("no Mooncake wheel here (make mooncake-venv installs it into build/venv-mooncake)")
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    engines = ["mooncake", "mcguard-socket-off", "mcguard-socket-tail", "mcguard-socket-digest+sync", "memcpy"]
    out = subprocess.run([VENV_PYTHON, "-m", "mcguard.tools.peerbench", "--rounds", "1", "--seconds", "0.05",
                          "--sizes", "512x16KiB", "--layout", "scattered", "--engines"] + engines,
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert "every destination matched its source" in out.stdout
    assert "layout: scattered destination blocks" in out.stdout
    assert out.stderr.count("round 1/1") == len(engines)


def test_serial_kind_turns_post_ahead_off():
    from mcguard.tools.peerbench import new_engine
    assert new_engine("mcguard-socket-tail~serial")._config["post_ahead"] is False
    assert "post_ahead" not in new_engine("mcguard-socket-tail")._config, "the guard's default (true)"
    with pytest.raises(SystemExit, match="for mcguard kinds"):
        new_engine("socket~serial")


def test_goals_table_says_met_not_met_and_not_run():
    from mcguard.tools import peergoals
    figs = {k: {"1x4KiB": 10.0, "64x256KiB": 4.0, "512x16KiB": 1.0, "4096x4KiB": 0.3} for k in peergoals.ENGINES}
    results = {(k, s): [v, v] for k, by in figs.items() for s, v in by.items()}
    rows = peergoals.rows(results, "tcp")
    assert len(rows) == 10 and all(set(r) == set(peergoals.COLUMNS) | {"profiled", "why"} for r in rows)
    assert all(r["why"] == "" for r in rows), "a goal met needs no why"
    assert all(tuple(p) in results for r in rows for p in r["profiled"]), "each row names the figures it judges"
    assert peergoals.missed_pairs(rows) == []
    assert all(r["met"] == "yes" for r in rows), "equal figures meet every goal"
    results[("mcguard-socket-digest", "1x4KiB")] = [20.0]  # twice off
    results[("guarded-mooncake-digest", "4096x4KiB")] = [0.1]
    del results[("nixl", "64x256KiB")]
    rows = {(r["path"], r["figure"]): r for r in peergoals.rows(results, "tcp")}
    assert rows[("sockets", "1 x 4 KiB µs: off / tail / digest")]["met"] == "NO"
    assert rows[("sockets", "64 x 256 KiB GB/s: off / tail")]["met"] == "not run"
    digest = [r for (p, f), r in rows.items() if f.startswith("digest: fraction")][0]
    assert digest["met"] == "NO" and "0.33" in digest["mcguard"]
    assert "4 of 10" not in peergoals.table(list(rows.values()))
    assert "goals met (medians of this run)" in peergoals.table(list(rows.values()))
    consecutive = peergoals.table(list(rows.values()), "consecutive")
    assert "layout consecutive: " + peergoals.LAYOUT_NOTES["consecutive"] in consecutive.splitlines()
    assert "joins consecutive blocks" in consecutive and "--layout scattered" in consecutive
    assert "nothing is joined" in peergoals.table(list(rows.values()), "scattered")
    missed = peergoals.missed_pairs(list(rows.values()))
    assert missed[:2] == [("mcguard-socket-off", "1x4KiB"), ("mcguard-socket-digest", "1x4KiB")]
    assert ("guarded-mooncake-digest", "4096x4KiB") in missed and ("mooncake", "4096x4KiB") in missed
    assert len(missed) == len(set(missed)), "each pair once"
    assert ("mcguard-off", "1x4KiB") not in missed, "a goal met shows no profile"


def test_goals_table_says_in_how_many_rounds_each_goal_is_met():
    from mcguard.tools import peergoals
    figs = {k: {"1x4KiB": 10.0, "64x256KiB": 4.0, "512x16KiB": 1.0, "4096x4KiB": 0.3} for k in peergoals.ENGINES}
    results = {(k, s): [v, v, v] for k, by in figs.items() for s, v in by.items()}
    # digest: 1.1 x off in rounds 1 and 3, 1.3 x in round 2; the median (11) meets 1.15 x
    results[("mcguard-socket-digest", "1x4KiB")] = [11.0, 13.0, 10.5]
    # NIXL faster than tail in every round
    results[("nixl", "64x256KiB")] = [5.0, 4.5, 4.2]
    del results[("guarded-mooncake-digest", "1x4KiB")]
    rows = {(r["path"], r["figure"]): r for r in peergoals.rows(results, "tcp")}
    digest = rows[("sockets", "1 x 4 KiB µs: off / tail / digest")]
    assert (digest["met"], digest["rounds met"]) == ("yes", "2 of 3")
    tput = rows[("sockets", "64 x 256 KiB GB/s: off / tail")]
    assert (tput["met"], tput["rounds met"]) == ("NO", "0 of 3")
    lat = rows[("over Mooncake's engine", "1 x 4 KiB µs: tail / digest")]
    assert (lat["met"], lat["rounds met"]) == ("not run", "-")
    assert rows[("one host", "64 x 256 KiB GB/s: off / tail")]["rounds met"] == "0 of 3", "the same NIXL"
    tail = [r for (p, f), r in rows.items() if f.startswith("tail: fraction")][0]
    assert (tail["met"], tail["rounds met"]) == ("yes", "3 of 3")


def test_goals_say_why_a_goal_was_missed():
    from mcguard.tools import peergoals
    figs = {k: {"1x4KiB": 10.0, "64x256KiB": 4.0, "512x16KiB": 1.0, "4096x4KiB": 0.3} for k in peergoals.ENGINES}
    results = {(k, s): [v, v] for k, by in figs.items() for s, v in by.items()}
    results[("mcguard-digest+sync-read", "1x4KiB")] = [20.0, 20.0]  # twice off + done
    results[("mooncake", "1x4KiB")] = [50.0, 50.0]
    results[("guarded-mooncake-tail", "1x4KiB")] = [80.0, 82.0]
    results[("guarded-mooncake-digest", "1x4KiB")] = [70.0, 70.0]
    results[("nixl", "64x256KiB")] = [4.4, 4.8]  # above tail (4.0) in both rounds
    results[("guarded-mooncake-digest", "64x256KiB")] = [2.0, 3.0]  # half and three quarters of Mooncake's 4.0
    profiles = {
        ("mcguard-off+ping", "1x4KiB"): [{"a transfer": 10.0, "in the library": 4.0, "checks": 0.1}],
        # A mean a µs above the round's median: the sender's extra time is the profiles' (21 - 6 - 10).
        ("mcguard-digest+sync-read", "1x4KiB"): [
            {"a transfer": 21.0, "in the library": 6.5, "checks": 1.0, "receiver's call": 6.0,
             "receiver's sync": 3.5}],
        ("mooncake", "1x4KiB"): [{"a transfer": 52.0}, {"a transfer": 54.0}],
        ("guarded-mooncake-tail", "1x4KiB"): [{"a transfer": 82.0, "engine's calls": 72.0}],
        ("mooncake", "64x256KiB"): [{"a transfer": 900.0}],
        ("guarded-mooncake-digest", "64x256KiB"): [{"a transfer": 1000.0, "engine's calls": 950.0}],
    }
    rows = {(r["path"], r["figure"]): r for r in peergoals.rows(results, "tcp", profiles)}
    done = rows[("one host", "off + done / digest + the receiver's sync, µs")]
    assert done["met"] == "NO"
    assert done["why"] == ("the goal leaves 2.0 µs above off + done; digest + sync took 10.0 more: the receiver's "
                           "sync_transfers call 6.0 µs in its process (3.5 in the library), and the sender's "
                           "transfer 5.0 µs more than off's (in the library 2.5 more, its fence and check 1.0)")
    lat = rows[("over Mooncake's engine", "1 x 4 KiB µs: tail / digest")]
    assert lat["why"] == ("the goal leaves 15.0 µs above Mooncake alone (50.0); tail: Mooncake's calls inside the "
                          "guard took 72.0 µs a transfer against 53.0 for Mooncake alone, the guard's own time "
                          "(checks, its path, the wrapper) 10.0")
    # no profile of digest: no sentence about it (the assert above)
    frac = [r for (p, f), r in rows.items() if f.startswith("digest: fraction")][0]
    assert frac["why"] == ("at 64x256KiB the fraction by round 0.50 / 0.75: Mooncake's calls inside the guard took "
                           "950 µs a transfer against 900 for Mooncake alone, the guard's own time (checks, its "
                           "path, the wrapper) 50"), "only the shape that missed"
    tput = rows[("sockets", "64 x 256 KiB GB/s: off / tail")]
    assert tput["why"] == "by round, tail 4.00 / 4.00 GB/s; NIXL 4.40 / 4.80 GB/s"
    assert rows[("sockets", "1 x 4 KiB µs: off / tail / digest")]["why"] == "", "met"
    text = peergoals.table(list(rows.values()))
    assert "Why, for the goals not met" in text
    assert "- one host, off + done / digest + the receiver's sync, µs: the goal leaves 2.0 µs" in text
    # Without profiles, the figures alone.
    bare = {(r["path"], r["figure"]): r for r in peergoals.rows(results, "tcp")}
    assert bare[("one host", "off + done / digest + the receiver's sync, µs")]["why"] == \
        "the goal leaves 2.0 µs above off + done; digest + sync took 10.0 more"
    assert peergoals.table(list(bare.values())).count("\n- ") == 5, "one line per goal missed"
    # Sockets: digest + sync within 1.2 x, but off + done above Mooncake + done.
    results[("mcguard-socket-off+ping", "1x4KiB")] = [85.0, 85.0]
    results[("mcguard-socket-digest+sync-read", "1x4KiB")] = [92.0, 92.0]
    results[("mooncake+ping", "1x4KiB")] = [80.0, 80.0]
    sock = {(r["path"], r["figure"]): r for r in peergoals.rows(results, "tcp")}[
        ("sockets", "off + done / digest + the receiver's sync, µs")]
    assert sock["met"] == "NO"
    assert sock["why"] == ("the goal leaves 17.0 µs above off + done; digest + sync took 7.0 more (within it); "
                           "off + done took 85.0 µs against Mooncake + done 80.0")


def test_profile_splits_a_transfers_time():
    from mcguard.tools import peerprofile
    sender = {"transfers": 10, "transfer_ns": 1_000_000, "check_ns": 200_000, "engine_calls": 10,
              "engine_call_ns": 500_000}
    before = peerprofile.reading(sender, {"sync_calls": 0, "sync_ns": 0})
    after = peerprofile.reading(dict(sender, transfers=14, transfer_ns=1_400_000, check_ns=240_000,
                                     engine_call_ns=800_000), {"sync_calls": 2, "sync_ns": 30_000})
    prof = peerprofile.profile(before, after, 4, 4 * 120e-6)
    assert prof == pytest.approx({"a transfer": 120.0, "in the library": 100.0, "checks": 10.0,
                                  "engine's calls": 75.0, "the rest": 15.0, "outside the library": 20.0,
                                  "receiver's sync": 15.0})
    # mcguard's own planes: no engine column; no guard: the transfer's time alone
    own = peerprofile.profile(peerprofile.reading({"transfers": 0}, {}),
                              peerprofile.reading({"transfers": 2, "transfer_ns": 20_000, "check_ns": 4_000}, {}),
                              2, 2 * 12e-6)
    assert "engine's calls" not in own and own["the rest"] == pytest.approx(8.0)
    assert peerprofile.profile(None, None, 3, 3e-3) == {"a transfer": pytest.approx(1000.0)}
    text = peerprofile.table({("x", "1x4KiB"): [prof, dict(prof, checks=30.0)], ("y", "1x4KiB"): [own]},
                             [("y", "1x4KiB"), ("x", "1x4KiB"), ("z", "1x4KiB")])
    lines = text.splitlines()
    assert lines[2].split()[:2] == ["y", "1x4KiB"] and lines[3].split()[:2] == ["x", "1x4KiB"], "in the order asked"
    assert lines[3].split()[5] == "20.0", "the median over rounds"
    assert "z" not in [line.split()[0] for line in lines[2:4]], "a pair that was not run has no row"
