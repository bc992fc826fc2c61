"""torch.distributed with fastoptim, two processes on this CPU (gloo): FSDP2 and ZeRO-1 train exactly like one
process, and `fastoptim train --ddp` runs under torchrun and resumes."""

import json
import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(__file__)


def torchrun(*args, timeout=240):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=HERE)


@pytest.fixture(scope="module")
def dist_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist") / "out.json"
    proc = torchrun(os.path.join(HERE, "dist_worker.py"), str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("impl", ["loop", "foreach", "fused", "compiled"])
def test_fsdp2_matches_one_process(dist_results, impl):
    assert dist_results[f"fsdp2 {impl}"] < 1e-6


def test_zero1_matches_one_process(dist_results):
    assert dist_results["zero1"] < 1e-6


def test_train_ddp_under_torchrun_and_resume(tmp_path):
    common = ["-m", "fastoptim", "train", "--ddp", "--n-layer", "1", "--n-embd", "32", "--n-head", "2",
              "--n-kv-head", "1", "--block-size", "32", "--batch-size", "4", "--steps", "8", "--warmup", "2",
              "--eval-every", "4", "--eval-batches", "1", "--save-every", "4", "--sample-tokens", "0",
              "--no-progress", "--out-dir", str(tmp_path)]
    first = torchrun(*common, "--stop-after", "4")
    assert first.returncode == 0, first.stderr[-3000:]
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    assert ckpt["step"] == 4 and len(ckpt["data_rng"]) == 2  # each rank's data order is saved
    second = torchrun(*common, "--resume", "--json", str(tmp_path / "s.json"))
    assert second.returncode == 0, second.stderr[-3000:]
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["steps"] == 8 and len(summary["log"]) == 8
