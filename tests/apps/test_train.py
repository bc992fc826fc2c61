"""`fastoptim train` at tiny sizes: it learns, it resumes bit-identically, bad input gets a clear message."""

import json
import os
import subprocess
import sys

import pytest
import torch

from fastoptim.cli import main as cli
from fastoptim.train import GPT, GPTConfig, TrainConfig, main
from fastoptim.train import checkpoint
from conftest import STORED, quantized


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


@pytest.mark.parametrize("clip", [1.0, None])
def test_gradient_release_trains_exactly_as_the_step_after_backward(tmp_path, clip):
    """``--gradient-release`` (with accumulation, 8-bit state, and clipping through a measuring backward): the
    same losses and params, bit for bit, as the ordinary loop; and it resumes from its checkpoint."""
    run = dict(steps=6, state_bits=8, n_embd=64, sample_tokens=0, save_every=3, eval_every=3, grad_accum_steps=2,
               max_grad_norm=clip)
    ordinary = main(tiny(tmp_path / "a", **run))
    main(tiny(tmp_path / "b", stop_after=3, gradient_release=True, **run))
    released = main(tiny(tmp_path / "b", resume=True, gradient_release=True, **run))
    assert [e["loss"] for e in released["log"]] == [e["loss"] for e in ordinary["log"]]
    a = torch.load(tmp_path / "a" / "out" / "ckpt.pt", weights_only=False)
    b = torch.load(tmp_path / "b" / "out" / "ckpt.pt", weights_only=False)
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert released["peak_rss_mb"] > 0


@pytest.mark.parametrize("bits", STORED)
def test_low_bit_state_trains_and_resumes_bit_identically(tmp_path, bits):
    """n_embd 64: the 64x64 and wider matrices hold 4096+ elements, so 8/4 bits quantize them."""
    run = dict(steps=8, state_bits=bits, n_embd=64, sample_tokens=0, save_every=4, eval_every=4)
    straight = main(tiny(tmp_path / "a", **run))
    main(tiny(tmp_path / "b", stop_after=4, **run))
    resumed = main(tiny(tmp_path / "b", resume=True, **run))
    assert [e["loss"] for e in resumed["log"]] == [e["loss"] for e in straight["log"]]
    optim = torch.load(tmp_path / "a" / "out" / "ckpt.pt", weights_only=False)["optimizer"]
    names = {name for entry in optim["state"].values() for name in entry}
    assert ("exp_avg.codes" in names) == quantized(bits), names


def test_bf16_params_with_stochastic_rounding_and_8_bit_state_resume_bit_identically(tmp_path):
    """``--dtype bf16 --rounding stochastic``: bf16 params, no fp32 copy anywhere, each step rounded from the
    random stream the optimizer state carries; a resumed run draws the same bits."""
    run = dict(steps=6, state_bits=8, dtype="bf16", rounding="stochastic", n_layer=1, n_embd=64, sample_tokens=0,
               save_every=3, eval_every=3, eval_batches=1)
    straight = main(tiny(tmp_path / "a", **run))
    assert straight["param_dtype"] == "bf16"
    main(tiny(tmp_path / "b", stop_after=3, **run))
    resumed = main(tiny(tmp_path / "b", resume=True, **run))
    assert [e["loss"] for e in resumed["log"]] == [e["loss"] for e in straight["log"]]
    a, b = (torch.load(tmp_path / d / "out" / "ckpt.pt", weights_only=False) for d in "ab")
    assert {v.dtype for v in a["model"].values()} == {torch.bfloat16}
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    names = {name for entry in a["optimizer"]["state"].values() for name in entry}
    assert {"exp_avg.codes", "rounding_rng"} <= names and "kahan_comp" not in names, names


def test_param_dtype_follows_dtype_only_when_a_rounding_asks_for_16_bit_params():
    from fastoptim.train.loop import param_dtype
    assert param_dtype(TrainConfig(dtype="bf16")) == "fp32"  # nanoGPT's meaning: autocast over fp32 params
    assert param_dtype(TrainConfig(dtype="bf16", rounding="stochastic")) == "bf16"
    assert param_dtype(TrainConfig(dtype="fp16", rounding="kahan")) == "fp16"
    assert param_dtype(TrainConfig(param_dtype="bf16")) == "bf16"  # bf16 params rounded to nearest, as torch


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


def test_flat_buffers_with_8_bit_state_train(tmp_path):
    summary = main(tiny(tmp_path, steps=10, flat=True, state_bits=8, sample_tokens=0))
    losses = [e["loss"] for e in summary["log"]]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


@pytest.mark.parametrize("argv,message", [
    (["--data", "/no/such/file.txt"], "data file not found"),
    (["--resume", "--out-dir", "/no/such/dir"], "no checkpoint"),
    (["--fp8"], "compute capability"),
    (["--steps", "0"], "steps must be >= 1"),
    (["--rounding", "stochastic"], "the params are fp32: add --dtype bf16"),
    (["--rounding", "stochastic", "--param-dtype", "fp16"], "for fp16 params use --rounding kahan"),
    (["--rounding", "kahan", "--dtype", "bf16", "--flat"], "--flat rounds params to nearest"),
    (["--gradient-release", "--flat"], "cannot run with --flat"),
    (["--gradient-release", "--dtype", "fp16"], "--dtype fp16 (GradScaler"),
    (["--gradient-release", "--ddp"], "--ddp and clipping"),
    (["--gradient-release", "--fsdp"], "--fsdp and clipping"),
])
def test_bad_settings_get_a_clear_message(argv, message, capsys):
    assert cli(["train", *argv]) == 2
    assert message in capsys.readouterr().err


def test_unknown_flag_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli(["train", "--n-layers", "3"])
    assert exit_.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err


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


@pytest.mark.slow
def test_compiled_model_and_compiled_optimizer(tmp_path):
    # one layer: a second would be traced and compiled the same way again (10 s of a 57 s test, cold)
    summary = main(tiny(tmp_path, steps=3, compile=True, impl="compiled", sample_tokens=5, n_layer=1))
    assert len(summary["log"]) == 3 and all(e["loss"] == e["loss"] for e in summary["log"])


def test_train_loop_times_between_device_syncs(tmp_path, monkeypatch):
    """On a GPU the step's clock reads wait for the device: every read of the clock in the loop follows a
    sync, and the optimizer's share is timed from a sync after backward to a sync after the step."""
    from fastoptim import timing

    events = []
    monkeypatch.setitem(timing.SYNC, "cpu", lambda device: events.append("sync"))  # the CPU, made cuda-like
    real = timing.perf_counter
    monkeypatch.setattr(timing, "perf_counter", lambda: events.append("read") or real())
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    hook = register_optimizer_step_pre_hook(lambda *args: events.append("step"))
    try:
        summary = main(tiny(tmp_path, steps=3, sample_tokens=0))
    finally:
        hook.remove()
    assert events == ["sync", "read", "sync", "read", "step", "sync", "read"] * 3
    assert 0 < summary["optimizer_share"] < 1


def _record_file_ops(monkeypatch) -> list:
    """os.fsync (with the path its fd names), os.replace and os.rename, in the order they happen."""
    events = []
    fsync, replace, rename = os.fsync, os.replace, os.rename

    def record_fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return fsync(fd)

    def record(name, real):
        def call(src, dst, *args, **kwargs):
            events.append((name, os.path.realpath(src), os.path.realpath(dst)))
            return real(src, dst, *args, **kwargs)
        return call

    monkeypatch.setattr(os, "fsync", record_fsync)
    monkeypatch.setattr(os, "replace", record("replace", replace))
    monkeypatch.setattr(os, "rename", record("rename", rename))
    return events


needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads fd paths from /proc")


@needs_proc
def test_checkpoint_is_fsynced_before_the_rename_and_its_folder_after(tmp_path, monkeypatch):
    events = _record_file_ops(monkeypatch)
    folder = os.path.realpath(tmp_path)
    path = os.path.join(folder, "ckpt.pt")
    checkpoint.save({"step": 1, "w": torch.arange(4)}, path)
    tmp = f"{path}.tmp.{os.getpid()}"
    assert ("replace", tmp, path) in events
    rename = events.index(("replace", tmp, path))
    assert ("fsync", tmp) in events[:rename]  # the data is on the disk before the name points at it
    assert ("fsync", folder) in events[rename:]  # and the rename itself is made durable
    assert torch.load(path, weights_only=False)["step"] == 1


@needs_proc
def test_dcp_folder_is_fsynced_then_renamed_then_its_parent_fsynced(tmp_path, monkeypatch):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import fastoptim
    from fastoptim.train.checkpoint import save_sharded

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        fully_shard(net)
        opt = fastoptim.AdamW(net.parameters(), lr=1e-2)
        net(torch.randn(3, 4)).sum().backward()
        opt.step()
        folder = os.path.realpath(tmp_path)
        os.makedirs(os.path.join(folder, "dcp-00000001-0badc0de.tmp"))  # a killed save's leftovers
        events = _record_file_ops(monkeypatch)
        name = save_sharded(net, opt, folder, 2, master=True)
    finally:
        monkeypatch.undo()
        dist.destroy_process_group()
    final, tmp = os.path.join(folder, name), os.path.join(folder, name + ".tmp")
    assert sorted(os.listdir(folder)) == [name]
    renames = [i for i, e in enumerate(events) if e[0] in ("rename", "replace") and e[1] == tmp]
    assert len(renames) == 1 and events[renames[0]][2] == final
    before, after = events[:renames[0]], events[renames[0]:]
    files = os.listdir(final)
    assert files and all(("fsync", os.path.join(tmp, f)) in before for f in files)
    assert ("fsync", tmp) in before and ("fsync", folder) in after


def test_saves_and_resumes_remove_temp_files_of_killed_saves(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = out / f"ckpt.pt.tmp.{os.getppid()}"  # a process that is still running may be saving: left alone
    live.write_bytes(b"x")

    def leave_stale_files():  # what kill -9 during a save leaves (this pid: an earlier process's, reused)
        stale = [out / f"ckpt.pt.tmp.{dead.pid}", out / f"ckpt.pt.tmp.{os.getpid()}"]
        for f in stale:
            f.write_bytes(b"\0" * 1000)
        return stale

    stale = leave_stale_files()
    main(tiny(tmp_path, steps=4, stop_after=2, sample_tokens=0))
    assert not any(f.exists() for f in stale) and live.exists()
    stale = leave_stale_files()
    main(tiny(tmp_path, steps=4, resume=True, sample_tokens=0))
    assert not any(f.exists() for f in stale) and live.exists()
    ckpt = torch.load(out / "ckpt.pt", weights_only=False)
    assert ckpt["step"] == 4 and len(ckpt["log"]) == 4


class _Unpicklable:
    def __reduce__(self):
        raise RuntimeError("cannot pickle this")


def test_a_save_that_fails_midway_leaves_the_old_checkpoint_and_no_temp_file(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    checkpoint.save({"step": 1, "w": torch.arange(10)}, path)
    with pytest.raises(RuntimeError, match="cannot pickle"):
        checkpoint.save({"step": 2, "w": torch.zeros(100_000), "bad": _Unpicklable()}, path)
    assert os.listdir(tmp_path) == ["ckpt.pt"]
    old = torch.load(path, weights_only=False)
    assert old["step"] == 1 and torch.equal(old["w"], torch.arange(10))


def test_a_failure_in_training_is_reported_whole_with_its_rank(tmp_path, monkeypatch, capsys):
    """Under torchrun a rank's one-line gloo error hid the real cause: the CLI prints the whole traceback
    (chained causes too), names the rank, and writes torchrun's error file so its summary shows it."""
    import fastoptim.train

    def failing_main(cfg):
        try:
            raise OSError("the real cause")
        except OSError as e:
            raise RuntimeError("Connection closed by peer") from e

    monkeypatch.setattr(fastoptim.train, "main", failing_main)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    assert cli(["train", "--out-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "rank 1 of 2" in err and "Traceback" in err and "failing_main" in err
    assert "OSError: the real cause" in err and "RuntimeError: Connection closed by peer" in err
    record = json.loads((tmp_path / "error.json").read_text())["message"]
    assert "Connection closed by peer" in record["message"]
    assert "the real cause" in record["extraInfo"]["py_callstack"]


TINY_ARGV = ["--n-layer", "1", "--n-head", "2", "--n-kv-head", "1", "--n-embd", "64", "--block-size", "32",
             "--batch-size", "4", "--steps", "4", "--warmup", "1", "--eval-every", "4", "--eval-batches", "1",
             "--save-every", "4", "--sample-tokens", "0", "--no-progress"]


def test_state_format_trains_as_state_bits_and_the_summary_names_it(tmp_path):
    """``--state-format int8`` is ``--state-bits 8``: the same losses and 8-bit codes in the checkpoint; the
    summary names the format, and the checkpoint's config both spellings."""
    summaries = {}
    for flags in (["--state-format", "int8"], ["--state-bits", "8"],
                  ["--state-bits", "8", "--state-format", "dynamic8"]):
        out = tmp_path / "_".join(flags)
        assert cli(["train", *TINY_ARGV, *flags, "--out-dir", str(out), "--json", str(out / "s.json")]) == 0
        summaries[tuple(flags)] = json.loads((out / "s.json").read_text())
        saved = torch.load(out / "ckpt.pt", weights_only=False)
        assert any("exp_avg.codes" in entry for entry in saved["optimizer"]["state"].values())
        assert (saved["config"]["state_format"], saved["config"]["state_bits"]) == ("dynamic8", 8)
    losses = [[e["loss"] for e in s["log"]] for s in summaries.values()]
    assert losses[0] == losses[1] == losses[2]
    assert {s["state_format"] for s in summaries.values()} == {"dynamic8"}


def test_a_config_whose_state_format_and_state_bits_disagree_is_refused():
    from fastoptim.train.loop import check_config

    with pytest.raises(ValueError, match="--state-bits 16 and --state-format int8 name different state formats"):
        check_config(TrainConfig(state_bits=16, state_format="int8"))
    check_config(TrainConfig(state_format="int8"))  # state_bits left at its default: the format decides


def test_gradient_release_runs_with_fsdp_and_ddp_without_clipping():
    """Under FSDP2 each sharded param's bucket steps after its reduce-scatter, under DDP after its all-reduce (the
    optimizer tied to the DDP model; runs: test_distributed.py); neither with the measuring backward of clipping."""
    from fastoptim.train.loop import check_config

    for kind in ("ddp", "fsdp"):
        check_config(TrainConfig(gradient_release=True, max_grad_norm=None, **{kind: True}))
        with pytest.raises(ValueError, match=f"--{kind} and clipping"):
            check_config(TrainConfig(gradient_release=True, **{kind: True}))
