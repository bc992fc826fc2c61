"""`fastoptim train` at tiny sizes: it learns, it resumes bit-identically, bad input gets a clear message."""

import os
import subprocess
import sys

import pytest
import torch

from fastoptim.cli import main as cli
from fastoptim.train import GPT, GPTConfig, TrainConfig, main


def tiny(tmp_path, **kw) -> TrainConfig:
    base = dict(n_layer=2, n_head=2, n_kv_head=1, n_embd=32, block_size=32, batch_size=4, steps=20, warmup=2,
                eval_every=10, eval_batches=2, save_every=5, sample_tokens=20, progress=False,
                out_dir=str(tmp_path / "out"), lr=1e-2)
    base.update(kw)
    return TrainConfig(**base)


def test_tiny_run_learns_and_reports(tmp_path):
    summary = main(tiny(tmp_path, steps=40))
    losses = [e["loss"] for e in summary["log"]]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5  # from ~5.5 (uniform over bytes) clearly down
    assert summary["val_loss"] < 5.0 and summary["tokens_per_s"] > 0 and 0 < summary["optimizer_share"] < 1
    assert summary["mfu"] is None  # a CPU has no peak in the table: achieved GFLOP/s instead
    assert isinstance(summary["sample"], str) and len(summary["sample"]) > 0
    assert os.path.isfile(tmp_path / "out" / "ckpt.pt")


@pytest.mark.parametrize("impl,flat", [("fused", False), ("foreach", True)])
def test_resume_is_bit_identical(tmp_path, impl, flat):
    straight = main(tiny(tmp_path / "a", steps=10, impl=impl, flat=flat, sample_tokens=0))
    main(tiny(tmp_path / "b", steps=10, stop_after=5, impl=impl, flat=flat, sample_tokens=0))
    resumed = main(tiny(tmp_path / "b", steps=10, impl=impl, flat=flat, resume=True, sample_tokens=0))
    assert [e["loss"] for e in resumed["log"]] == [e["loss"] for e in straight["log"]]
    a = torch.load(tmp_path / "a" / "out" / "ckpt.pt", weights_only=False)["model"]
    b = torch.load(tmp_path / "b" / "out" / "ckpt.pt", weights_only=False)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_checkpoint_is_replaced_atomically(tmp_path):
    main(tiny(tmp_path, steps=10, sample_tokens=0))
    leftovers = [f for f in os.listdir(tmp_path / "out") if ".tmp." in f]
    assert leftovers == []


def test_text_and_bin_data_files(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("hello fastoptim " * 400)
    assert main(tiny(tmp_path / "x", data=str(text), steps=3, sample_tokens=0))["params"] > 0
    tokens = torch.randint(0, 300, (5000,), dtype=torch.int64).to(torch.uint16)
    binary = tmp_path / "t.bin"
    binary.write_bytes(tokens.numpy().tobytes() if hasattr(tokens, "numpy") else bytes(tokens.untyped_storage()))
    summary = main(tiny(tmp_path / "y", data=str(binary), steps=3, sample_tokens=0))
    model = GPT(GPTConfig(vocab_size=300, block_size=32, n_layer=2, n_head=2, n_kv_head=1, n_embd=32))
    assert summary["params"] == model.num_params()  # vocab from the token ids


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_low_precision_autocast_trains(tmp_path, dtype):
    summary = main(tiny(tmp_path, steps=15, dtype=dtype, sample_tokens=0))
    assert all(torch.isfinite(torch.tensor(e["loss"])) for e in summary["log"])


@pytest.mark.parametrize("argv,message", [
    (["--data", "/no/such/file.txt"], "data file not found"),
    (["--resume", "--out-dir", "/no/such/dir"], "no checkpoint"),
    (["--fp8"], "compute capability"),
    (["--steps", "0"], "steps must be >= 1"),
    (["--state-bits", "8"], "only 32-bit"),
])
def test_bad_settings_get_a_clear_message(argv, message, capsys):
    assert cli(["train", *argv]) == 2
    assert message in capsys.readouterr().err


def test_unknown_flag_is_refused():
    proc = subprocess.run([sys.executable, "-m", "fastoptim", "train", "--n-layers", "3"], capture_output=True,
                          text=True)
    assert proc.returncode == 2 and "unrecognized arguments" in proc.stderr


def test_model_options():
    cfg = GPTConfig(n_layer=2, n_head=4, n_kv_head=1, n_embd=32, block_size=16, grad_checkpointing=True)
    model = GPT(cfg)
    x = torch.randint(0, 256, (2, 16))
    _, loss = model(x, x)
    loss.backward()
    assert model.head.weight is model.embed.weight  # tied
    with pytest.raises(ValueError, match="n_kv_head"):
        GPTConfig(n_head=4, n_kv_head=3)
    with pytest.raises(ValueError, match="block_size"):
        model(torch.randint(0, 256, (1, 17)))


def test_compiled_model_and_compiled_optimizer(tmp_path):
    summary = main(tiny(tmp_path, steps=3, compile=True, impl="compiled", sample_tokens=5))
    assert len(summary["log"]) == 3 and all(e["loss"] == e["loss"] for e in summary["log"])
