"""scripts/perf_report.py: tables from peerbench's JSON, and the page's
marked sections rewritten (the plots need matplotlib: make perf-report)."""

import importlib.util
import os

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
spec = importlib.util.spec_from_file_location("perf_report", os.path.join(ROOT, "scripts", "perf_report.py"))
perf_report = importlib.util.module_from_spec(spec)
spec.loader.exec_module(perf_report)

RUN = {"date": "2026-12-05", "rounds": 3, "seconds": 1.0, "latency_iters": 1000, "layout": "consecutive",
       "nixl_tls": "tcp", "engines": ["mooncake", "mcguard-tail"], "sizes": ["1x4KiB", "64x256KiB"],
       "units": {"1x4KiB": "us", "64x256KiB": "GB/s"},
       "machine": {"cpu": "cpu", "cores": 2, "kernel": "k", "python": "3", "mcguard": "0.3.3"},
       "figures": {"mooncake": {"1x4KiB": [50.0, 40.0, 45.0], "64x256KiB": [3.0, 4.0, 3.5]},
                   "mcguard-tail": {"1x4KiB": [5.0, 6.0, 4.0], "64x256KiB": [7.0, 7.5, 6.5]}},
       "mismatches": []}


def test_table_has_medians_spreads_and_ratios():
    t = perf_report.table(RUN)
    assert "| mooncake | 45.0 (40.0–50.0) | 3.50 (3.00–4.00) |" in t
    assert "| mcguard-tail | 5.0 (4.0–6.0) ×0.11 | 7.00 (6.50–7.50) ×2.00 |" in t
    assert "matched its source" in t


def test_mismatches_are_shown():
    assert "Destination mismatches" in perf_report.table(dict(RUN, mismatches=[[0, "1x4KiB", "mcguard-tail"]]))


def test_only_the_marked_section_is_rewritten(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("intro\n<!-- peer:begin -->\nold\n<!-- peer:end -->\nafter\n")
    assert perf_report.replace_section(str(page), "peer", "new")
    assert page.read_text() == "intro\n<!-- peer:begin -->\nnew\n<!-- peer:end -->\nafter\n"
    assert not perf_report.replace_section(str(page), "other", "x")
    page.write_text("<!-- peer:begin -->\n<!-- peer:end -->\n")
    assert perf_report.replace_section(str(page), "peer", "table")
    assert page.read_text() == "<!-- peer:begin -->\ntable\n<!-- peer:end -->\n"
