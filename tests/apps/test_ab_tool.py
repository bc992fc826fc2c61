"""tools/ab.py: another checkout's fastoptim imported beside this one, both stepped in alternating rounds."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_ab_times_a_tree_against_another_in_one_process():
    """This tree against itself (its src imported a second time, under another name): one line per config,
    each with both times and a ratio."""
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "ab.py"), os.path.join(ROOT, "src"),
                           "--workload", "flat", "--params", "4096", "--rounds", "4", "--steps", "1", "--bits", "32,8",
                           "--impls", "fused", "--flat", ""], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = re.findall(r"^fused\s+(\d+)-bit\s+old\s+([\d.]+) ms\s+new\s+([\d.]+) ms\s+new/old ([\d.]+)", done.stdout, re.M)
    assert [bits for bits, *_ in rows] == ["32", "8"], done.stdout
    for _, old, new, ratio in rows:
        assert float(old) > 0 and float(new) > 0 and float(ratio) > 0
