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


def test_train_fsdp2_checkpoints_through_dcp_and_resumes_exactly(tmp_path):
    common = ["-m", "fastoptim", "train", "--fsdp", "--n-layer", "1", "--n-embd", "32", "--n-head", "2",
              "--n-kv-head", "1", "--block-size", "32", "--batch-size", "4", "--steps", "8", "--warmup", "2",
              "--eval-every", "4", "--eval-batches", "1", "--save-every", "4", "--sample-tokens", "0",
              "--no-progress"]
    straight = torchrun(*common, "--out-dir", str(tmp_path / "a"), "--json", str(tmp_path / "a.json"))
    assert straight.returncode == 0, straight.stderr[-3000:]
    half = torchrun(*common, "--out-dir", str(tmp_path / "b"), "--stop-after", "4")
    assert half.returncode == 0, half.stderr[-3000:]
    assert (tmp_path / "b" / "dcp").is_dir() and not (tmp_path / "b" / "dcp.tmp").exists()
    rest = torchrun(*common, "--out-dir", str(tmp_path / "b"), "--resume", "--json", str(tmp_path / "b.json"))
    assert rest.returncode == 0, rest.stderr[-3000:]
    losses = [[e["loss"] for e in json.loads((tmp_path / f"{r}.json").read_text())["log"]] for r in "ab"]
    assert losses[0] == losses[1] and len(losses[0]) == 8
