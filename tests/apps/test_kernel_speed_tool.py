"""tools/kernel_speed.py: one step's CPU kernel call kept and timed alone, at each stored format."""

import os
import re
import subprocess
import sys

import pytest

from fastoptim.paths.cpu_kernel import kernels as cpu_kernels

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.skipif(cpu_kernels.available() is not None, reason="no CPU kernel builds here")
def test_kernel_speed_times_the_kernel_call_of_each_format_beside_torch():
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "kernel_speed.py"), "--rows", "4",
                           "--cols", "256", "--rounds", "2", "--formats", "bf16", "fp8"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = re.findall(r"^\| (.+?) \| ([\d.]+) ns an element \|$", done.stdout, re.M)
    labels = [label for label, _ in rows]
    assert labels == ["torch fused fp32 (whole step)", "bf16 (kernel)", "fp8 (kernel)"], done.stdout
    assert all(float(ns) > 0 for _, ns in rows)


def test_kernel_speed_says_so_when_a_step_runs_no_kernel(monkeypatch):
    """A format the kernel does not take (fp32 state runs torch's fused step): a clear error, not a time."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import kernel_speed
    finally:
        sys.path.pop(0)
    with pytest.raises(RuntimeError, match="kernel calls, not one"):
        kernel_speed.kernel_call("fp32", (4, 256))
