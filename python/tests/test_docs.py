"""README and docs/ as a newcomer reads them: README's Python snippets run
as written, every relative link names a file that exists, and the pages
describe what is (no work periods, no issue numbers)."""

import glob
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PAGES = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "examples", "README.md")] + \
    sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


def read(path):
    with open(path) as f:
        return f.read()


def test_readme_is_short():
    assert len(read(PAGES[0]).splitlines()) <= 250


@pytest.mark.parametrize("n", range(len(re.findall(r"^```python$", read(PAGES[0]), re.M))))
def test_readme_python_snippet_runs(n):
    snippet = re.findall(r"^```python\n(.*?)^```", read(PAGES[0]), re.S | re.M)[n]
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    out = subprocess.run([sys.executable, "-c", snippet], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, snippet + out.stderr


@pytest.mark.parametrize("page", PAGES, ids=lambda p: os.path.relpath(p, ROOT))
def test_links_resolve(page):
    text = re.sub(r"^```.*?^```", "", read(page), flags=re.S | re.M)
    broken = []
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        if not os.path.exists(os.path.join(os.path.dirname(page), target)):
            broken.append(target)
    assert broken == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: os.path.relpath(p, ROOT))
def test_no_work_periods_or_issue_numbers(page):
    assert re.findall(r"(?i)session [0-9]|issue [0-9]|issue #", read(page)) == []
