"""The `fastoptim` command at tiny sizes: every option parses, the JSON has its documented schema."""

import json
import subprocess
import sys

import pytest
import torch

from fastoptim.bench import report as bench_report
from fastoptim.bench.peers import installed
from fastoptim.cli import main
from fastoptim.storage import PLAIN, codecs
from fastoptim.storage.codecs import Codec


def test_bench_quick_writes_json_and_markdown(tmp_path, capsys):
    out_json, out_md, out_png = tmp_path / "bench.json", tmp_path / "bench.md", tmp_path / "bench.png"
    rc = main(["bench", "--quick", "-w", "mlp2000", "flat", "--params", "50k", "-o", "adamw", "lion",
               "--impl", "loop", "fused", "--flat", "fused", "--clip", "1.0", "--threads", "1",
               "--json", str(out_json), "--markdown", str(out_md), "--plot", str(out_png)])
    assert rc == 0
    data = json.loads(out_json.read_text())
    assert data["schema_version"] == 1 and set(data) == {"schema_version", "environment", "config", "results",
                                                         "schedulers"}
    assert {r["workload"] for r in data["results"]} == {"mlp2000", "flat"}
    from fastoptim.paths.cpu_kernel import kernels as cpu_kernels
    env = data["environment"]  # where it ran, the CPU kernel's build included (it sets low-bit speed)
    assert env["cpu_kernel_simd_bits"] == cpu_kernels.simd_width() in (512, 256, 0) and env["cpu"]
    for result in data["results"]:
        assert set(result) == {"workload", "optimizer", "params", "tensors", "bytes_per_param", "gpu_estimate_ms",
                               "rows", "newton_schulz"}
        assert result["newton_schulz"] is None  # (Muon's only)
        labels = [r["label"] for r in result["rows"]]
        assert "flat floor" in labels and any("clip_grad_norm_" in label for label in labels)
        for row in result["rows"]:
            assert set(row) == {"label", "library", "impl", "flat", "paths", "median_ms", "min_ms", "max_ms", "samples",
                                "first_step_ms", "state_mib", "state_bits", "state_bytes", "state_bytes_per_param",
                                "peak_bytes", "peak_mib", "vs_torch_fused", "vs_flat_floor", "error"}
            assert row["error"] is None and row["median_ms"] > 0 and row["samples"] == 3
            assert row["peak_bytes"] >= row["state_bytes"] > 0  # (test_bench_memory.py: what the peak measures)
            assert row["vs_flat_floor"] is not None
    assert {s["label"] for s in data["schedulers"]} >= {"torch OneCycleLR", "fastoptim OneCycle"}
    assert "| row |" in out_md.read_text() and "| peak over p+g MiB |" in out_md.read_text()
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out_png.stat().st_size > 10_000
    out = capsys.readouterr().out
    assert "flat floor" in out and bench_report.environment_line(env) in out


@pytest.mark.slow
def test_bench_muon_reports_newton_schulz_flops_and_the_gemm_rate(tmp_path):
    out_json = tmp_path / "m.json"
    rc = main(["bench", "--quick", "-w", "mlp2000", "--params", "50k", "-o", "muon", "--impl", "loop", "fused",
               "--threads", "1", "--json", str(out_json)])
    assert rc == 0
    (result,) = json.loads(out_json.read_text())["results"]
    ns = result["newton_schulz"]
    assert ns["flops_per_step"] > 0 and ns["gemm_gflops"] > 0 and ns["dtype"] in ("bfloat16", "float32")
    labels = {row["label"] for row in result["rows"]}
    assert "torch loop" in labels  # torch.optim.Muon beside ours
    assert set(ns["rows"]) == labels - {"flat floor", "fastoptim AdamW fused"}  # (those run no Newton-Schulz)
    for rate in ns["rows"].values():
        assert rate["gflops"] > 0 and rate["of_gemm_rate"] == rate["gflops"] / ns["gemm_gflops"]


def test_bench_muon_rows_per_newton_schulz_method_with_their_flops_beside_adamw(tmp_path, capsys):
    """Muon's family gets the fused level once per preset and method, each with its own FLOPs (the cost
    functions'), its rate and its time over fused AdamW's on the same matrices; NorMuon, whose row moments
    flat=True cannot hold, gets no flat rows."""
    from fastoptim.bench import newton_schulz_flops
    from fastoptim.rules import newton_schulz as ns
    from fastoptim.rules.muon import fast_matmul_dtype

    out_json = tmp_path / "m.json"
    assert main(["bench", "--quick", "-w", "tiny_model:make", "-o", "muon", "normuon", "--impl", "fused", "--flat",
                 "fused", "--peers", "torch", "--no-schedulers", "--threads", "1", "--json", str(out_json)]) == 0
    shapes = [(100, 32), (64, 32), (100, 64)]  # tiny_model's matrices (the embedding's too), oriented wide below
    assert json.loads(out_json.read_text())["config"]["workload"] == ["tiny_model:make"]
    dtype = fast_matmul_dtype("cpu")
    methods = [f"{preset}/{method}" for preset in ns.PRESETS for method in ("standard", "gram")]
    for result in json.loads(out_json.read_text())["results"]:
        by_label = {r["label"]: r for r in result["rows"]}
        assert all(r["error"] is None for r in result["rows"])
        info = result["newton_schulz"]
        assert info["adamw_row"] == "fastoptim AdamW fused" and info["fused_row"] == "fastoptim fused"
        assert info["adamw_ms"] == by_label["fastoptim AdamW fused"]["median_ms"]
        assert set(info["rows"]) == set(by_label) - {"flat floor", "fastoptim AdamW fused"}
        assert {f"fastoptim fused {m}" for m in methods} <= set(info["rows"])
        assert ("fastoptim fused flat" in by_label) == (result["optimizer"] == "muon")
        assert ("torch loop" in by_label) == (result["optimizer"] == "muon")  # (torch has no NorMuon)
        for label, rate in info["rows"].items():
            coefficients, method = rate["method"].split(":")[0].split("/")
            schedule = ns.schedule(coefficients, 5)
            # the cost functions' count for the method each matrix takes (m <= n)
            costs = [(ns.gram_cost(m, n, schedule) if ns.resolve_method(method, m, n, schedule, dtype) == "gram"
                      else ns.standard_cost(m, n, 5)) for m, n in (sorted(s) for s in shapes)]
            assert rate["flops_per_step"] == sum(costs) == newton_schulz_flops(shapes, 5, coefficients, method, dtype)
            row = by_label[label]
            assert rate["gflops"] == rate["flops_per_step"] / row["median_ms"] / 1e6
            assert rate["vs_adamw"] == row["median_ms"] / info["adamw_ms"]
        for method in methods:
            assert info["rows"][f"fastoptim fused {method}"]["method"] == method
        gram, standard = (info["rows"][f"fastoptim fused keller/{m}"]["flops_per_step"] for m in ("gram", "standard"))
        assert gram < standard  # (the tiny model's matrices are wide enough for Gram iterations to pay)
        assert info["flops_per_step"] == info["rows"]["fastoptim fused"]["flops_per_step"]
    out = capsys.readouterr().out
    assert "NS GFLOP/step" in out and "x AdamW fused" in out and "fastoptim fused polar_express/gram" in out
    assert "fastoptim AdamW fused on the same params" in out


def test_newton_schulz_flops_follow_the_method_auto_takes():
    from fastoptim.bench import newton_schulz_flops
    from fastoptim.rules import newton_schulz as ns

    shapes = [(256, 64), (64, 80), (512, 512)]  # Gram pays on the first only
    schedule = ns.schedule("keller", 5)
    standard = [ns.standard_cost(*sorted(s), 5) for s in shapes]
    assert newton_schulz_flops(shapes, 5) == sum(standard)  # (the standard count, as before)
    fp32 = newton_schulz_flops(shapes, 5, "keller", "auto", torch.float32)
    assert fp32 == ns.gram_cost(64, 256, schedule) + sum(standard[1:]) < sum(standard)
    assert newton_schulz_flops(shapes, 5, "keller", "auto", torch.bfloat16) == sum(standard)  # auto: standard in bf16
    assert newton_schulz_flops(shapes, 0, "keller", "gram") == 0


def test_bench_a_users_module_with_installed_peers(tmp_path):
    out_json = tmp_path / "b.json"
    assert main(["bench", "--quick", "-w", "tiny_model:make", "--impl", "fused", "--flat",
                 "--no-schedulers", "--peers", "fp32", "--json", str(out_json)]) == 0
    result = json.loads(out_json.read_text())["results"][0]
    from tiny_model import make
    model = make()
    assert result["params"] == sum(p.numel() for p in model.parameters())
    labels = {r["label"] for r in result["rows"]}
    assert {"fastoptim fused", "torch fused", "flat floor"} <= labels
    for module, label in (("optimi", "optimi AdamW"), ("bitsandbytes", "bitsandbytes AdamW")):
        if installed(module):
            assert label in labels


@pytest.mark.parametrize("argv,message", [
    (["bench", "--workload", "nope"], "unknown workload"),
    (["bench", "--workload", "no.such.module:thing"], "cannot load workload"),
    (["bench", "--params", "lots"], "not a parameter count"),
    (["bench", "--optimizer", "adamq"], "invalid choice"),
])
def test_bad_flags_get_a_clear_message(argv, message, capsys):
    try:  # what ``python -m fastoptim`` exits with: ``sys.exit(main())``, or argparse's own exit
        status = main(argv)
    except SystemExit as exit_:
        status = exit_.code
    assert status == 2 and message in capsys.readouterr().err


def test_the_command_line_entry_point_exits_2_with_the_message():
    """``python -m fastoptim`` as users run it: argparse's exit status and message reach the shell (the cases
    above call ``main`` in this process)."""
    proc = subprocess.run([sys.executable, "-m", "fastoptim", "bench", "--optimizer", "adamq"], capture_output=True,
                          text=True)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


def test_bad_numbers_are_refused(capsys):
    assert main(["bench", "--rounds", "0"]) == 2
    assert main(["bench", "--clip", "-1"]) == 2
    assert "--clip" in capsys.readouterr().err


def test_curves_writes_png_json_and_matches_torch(tmp_path):
    png, out_json = tmp_path / "c.png", tmp_path / "c.json"
    assert main(["curves", "-o", "adamw", "lion", "--impl", "loop", "fused", "--flat", "fused", "--steps", "12",
                 "--out", str(png), "--json", str(out_json)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 10_000
    data = json.loads(out_json.read_text())
    assert {(d["optimizer"], d["curve"]) for d in data["differences"]} == {
        (o, c) for o in ("adamw", "lion") for c in ("loop", "fused", "fused flat")}
    for d in data["differences"]:
        assert d["max_abs_diff"] < 1e-4  # 32-bit state: the same curve as the reference
    losses = next(c["losses"] for c in data["curves"] if c["curve"] == "torch")
    assert len(losses) == 12 and losses[-1] < losses[0]  # it really trains


def test_curves_low_bit_state_and_bf16_params_beside_the_32_bit_run(tmp_path, capsys):
    out_json = tmp_path / "c.json"
    assert main(["curves", "-o", "adamw", "--impl", "fused", "--flat", "--steps", "20", "--state-bits", "8",
                 "--rounding", "nearest", "stochastic", "--lr", "3e-4", "--out", str(tmp_path / "c.png"),
                 "--json", str(out_json)]) == 0
    data = json.loads(out_json.read_text())
    assert [d["curve"] for d in data["differences"]] == ["fused"]  # the exactness table: 32-bit fp32 only
    gaps = {d["curve"]: d for d in data["precision_gaps"]}
    assert set(gaps) == {"fused 8-bit state", "fused bf16 params, nearest", "fused bf16 params, stochastic"}
    base = next(c["losses"] for c in data["curves"] if c["curve"] == "fused")
    for label, d in gaps.items():
        losses = next(c["losses"] for c in data["curves"] if c["curve"] == label)
        assert d["reference"] == "fused" and d["final_loss"] == sum(losses[-2:]) / 2  # the last tenth of 20
        assert d["gap_percent"] == pytest.approx((d["final_loss"] - sum(base[-2:]) / 2) / (sum(base[-2:]) / 2) * 100)
        assert losses != base  # another run, not the 32-bit one again
    assert (gaps["fused 8-bit state"]["state_bits"], gaps["fused bf16 params, stochastic"]["params"]) == (8, "bf16")
    out = capsys.readouterr().out
    assert "fused bf16 params, stochastic" in out and f"{gaps['fused 8-bit state']['gap_percent']:+.2f}%" in out


def test_curves_variant_options_reach_the_optimizer_and_its_reference(tmp_path, monkeypatch, capsys):
    """``-o 'muon[ns_coefficients=polar_express,ns_method=gram]'``: the options reach the level's optimizer and the
    reference's, the curves carry the text as written, and NorMuon (row moments) gets no flat run. No training:
    each run builds its optimizer on the model and returns a made-up curve."""
    from fastoptim import curves, registry
    from fastoptim.cli import build_parser
    from fastoptim.reference import ReferenceMuon

    variant = "muon[ns_coefficients=polar_express,ns_method=gram]"
    assert build_parser().parse_args(["curves", "-o", "adamw", variant]).optimizer == ["adamw", variant]
    assert registry.parse_variant("muon[ns_coefficients=(2.0, -1.5, 0.5), ns_steps=3]") == (
        "muon", {"ns_coefficients": (2.0, -1.5, 0.5), "ns_steps": 3})
    with pytest.raises(ValueError, match="ns_steps is given twice"):
        registry.parse_variant("muon[ns_steps=3,ns_steps=5]")
    built = []

    def train(name, make_optimizer, steps, seed, **kwargs):
        built.append((name, make_optimizer(curves.ByteMLP())))
        return [2.0] * steps

    monkeypatch.setattr(curves, "train", train)
    monkeypatch.setattr(curves, "plot", lambda result, path: None)
    out_json = tmp_path / "c.json"
    assert main(["curves", "-o", variant, "normuon[ns_steps=3]", "--impl", "fused", "--steps", "2",
                 "--out", str(tmp_path / "c.png"), "--json", str(out_json)]) == 0
    ours = [(name, opt) for name, opt in built if isinstance(opt, registry.get(name.split("[")[0]).cls)]
    assert [name for name, _ in ours] == [variant, variant, "normuon[ns_steps=3]"]  # fused, fused flat, fused
    for name, opt in ours:
        (group,) = [g for g in opt.param_groups if g["use_muon"]]
        assert group["lr"] == 0.02 and (
            (group["ns_coefficients"], group["ns_method"]) == ("polar_express", "gram") if name == variant
            else group["ns_steps"] == 3)
    reference = next(opt for name, opt in built if name == variant and not isinstance(opt, registry.get("muon").cls))
    (oracle,) = [o for o in reference.optimizers if isinstance(o, ReferenceMuon)]
    assert oracle.param_groups[0]["ns_coefficients"] == "polar_express" and oracle.ns_method == "gram"
    data = json.loads(out_json.read_text())
    assert {(d["optimizer"], d["curve"]) for d in data["differences"]} == {
        (variant, "fused"), (variant, "fused flat"), ("normuon[ns_steps=3]", "fused")}
    capsys.readouterr()
    with pytest.raises(SystemExit):  # the rule's own message, before anything runs
        main(["curves", "-o", "muon[ns_method=fast]"])
    assert "Invalid ns_method: 'fast'" in capsys.readouterr().err


@pytest.mark.parametrize("variant,refused", [
    ("muon[use_muon=False]", "'use_muon'"), ("muon[betas=(0.8, 0.9)]", "'betas'"),
    ("muon[maximize=True,amsgrad=True]", "'maximize', 'amsgrad'")])
def test_curves_refuses_variant_options_its_reference_cannot_take(variant, refused, capsys):
    """A variant's options go to its reference run too: options the recipe sets itself (``use_muon``), the AdamW
    groups' (``betas``) and options torch.optim.Muon lacks (``maximize``) are refused up front, each named, with
    the ones a variant takes; the recipe's reference lays out matrices itself (``split``, ``matrices``)."""
    from fastoptim import curves

    with pytest.raises(ValueError, match=f"takes no option {refused}; a muon variant takes: lr, "):
        curves.parse_variant(variant)
    with pytest.raises(SystemExit):
        main(["curves", "-o", variant])
    assert "ReferenceMuon" in capsys.readouterr().err
    assert curves.parse_variant("muon[ns_dtype=float32,ns_method=gram]") == (
        "muon", {"ns_dtype": "float32", "ns_method": "gram"})
    assert curves.parse_variant("muon[split=2,matrices=flatten]") == ("muon", {"split": 2, "matrices": "flatten"})


def test_curves_refuses_a_bad_lr(capsys):
    assert main(["curves", "--lr", "0"]) == 2
    assert "--lr must be > 0" in capsys.readouterr().err


def test_corpus_ships_with_python():
    from fastoptim import data
    text = data.corpus_bytes()
    assert len(text) > 300_000 and b"def" in text


def test_clock_synchronizes_cuda_devices_and_not_the_cpu(monkeypatch):
    import torch

    from fastoptim import timing

    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    timing.synchronize(timing.devices_of([torch.zeros(1), "cuda:1", torch.device("cuda", 1), "cuda:0"]))
    assert calls == [torch.device("cuda", 1), torch.device("cuda", 0)]  # each device once; the CPU never
    calls.clear()
    timing.clock([torch.zeros(1), "cpu"])()
    assert calls == []
    now = timing.clock(["cuda:0"])
    assert calls == [] and now() > 0 and calls == [torch.device("cuda", 0)]


def test_bench_times_each_step_between_device_syncs(monkeypatch):
    """Every timed step (the first one and each in the rounds) starts and ends with a synchronized device;
    warm-up steps are not timed."""
    import torch

    from fastoptim import timing
    from fastoptim.bench import runner

    events = []
    monkeypatch.setitem(timing.SYNC, "cpu", lambda device: events.append("sync"))  # the CPU, made cuda-like
    real = timing.perf_counter
    monkeypatch.setattr(timing, "perf_counter", lambda: events.append("read") or real())

    class Recorded:
        def __init__(self, params):
            self.opt = torch.optim.SGD(params, lr=0.1)
            self.state = self.opt.state

        def step(self):
            events.append("step")
            self.opt.step()

    row = runner.Row("recorded", "test", "loop", Recorded)
    runner.run_workload([(3, 2), (4,)], [row], rounds=2, steps_per_round=2, warmup=1)
    timed = ["sync", "read", "step", "sync", "read"]
    # the last step is the peak-memory instance's, after the rounds and outside any timing
    assert events == timed + ["step"] + timed * 4 + ["step"]
    assert len(row.times_ms) == 2 and row.error is None and row.peak_bytes is not None


def test_curves_rows_run_the_level_they_name(monkeypatch):
    """Routing on (as for users): the foreach and compiled rows of the curves still run their own paths."""
    from fastoptim import curves
    from fastoptim.engine import dispatch as levels
    from fastoptim.levels import record_paths
    monkeypatch.setattr(levels, "ROUTING", True)
    with record_paths() as paths:
        curves.run(["adamw"], ["foreach", "compiled"], [], steps=2)
    assert {"foreach", "compiled"} <= set(paths) and "torch_fused" not in paths
    assert levels.ROUTING is True  # restored


def test_bench_state_bits_rows_report_their_state_bytes(tmp_path):
    out_json = tmp_path / "b.json"
    assert main(["bench", "--quick", "-w", "gpt", "--params", "300k", "--impl", "fused", "--flat",
                 "--state-bits", "16", "8", "4", "--peers", "none", "--no-schedulers", "--json", str(out_json)]) == 0
    rows = {r["label"]: r for r in json.loads(out_json.read_text())["results"][0]["rows"]}
    full = rows["fastoptim fused"]["state_mib"]
    for bits, share in ((16, 0.5), (8, 0.27), (4, 0.15)):
        row = rows[f"fastoptim fused {bits}-bit state"]
        assert row["error"] is None and row["median_ms"] > 0
        assert row["state_mib"] < full * share + 0.1, (bits, row["state_mib"], full)  # 1-D params stay 32-bit


class _SharedMapState:
    """A peer that keeps state as bitsandbytes' 8-bit optimizers do: two uint8 codes per element of every param
    and one quantization map, the same tensor in every param's state."""

    def __init__(self, params):
        import torch
        shared_map = torch.zeros(256)
        self.state = {p: {"step": 1, "state1": torch.zeros_like(p, dtype=torch.uint8),
                          "state2": torch.zeros_like(p, dtype=torch.uint8), "qmap1": shared_map} for p in params}

    def step(self):
        pass


def _quantized_state_bytes(shapes, bits: int) -> int:
    """AdamW's two states at ``bits`` as the README states them: a >= 2-D param of 4096+ elements keeps per
    row ceil(cols * bits / 8) bytes of codes and one fp32 absmax per block (256 elements at 8 bits, 128 at 4);
    smaller params keep fp32."""
    import math
    total = 0
    for shape in shapes:
        numel = math.prod(shape)
        if len(shape) >= 2 and numel >= 4096:
            rows, cols = shape[0], numel // shape[0]
            block = 256 if bits == 8 else 128
            total += 2 * rows * (math.ceil(cols * bits / 8) + 4 * math.ceil(cols / block))
        else:
            total += 2 * 4 * numel
    return total


def test_bench_low_bit_peers_sit_beside_ours_with_exact_state_bytes_per_param(monkeypatch):
    """What ``--peers all --state-bits 8 4`` runs, with stand-in peers (the real low-bit ones take minutes)."""
    from fastoptim import bench
    from fastoptim.bench import peers

    fake8 = peers.Peer("shared-map AdamW8bit", "torch", lambda ps, kw: _SharedMapState(ps), 8)
    fake4 = peers.Peer("compiling AdamW4bit", "torch", lambda ps, kw: _SharedMapState(ps), 4, compiles=True)
    monkeypatch.setitem(peers.PEERS, "adamw", [fake8, fake4])
    assert {r.label for r in bench.rows_for("adamw", ["fused"], peers="fp32", state_bits=(8, 4))}.isdisjoint(
        {fake8.label, fake4.label})  # low-bit peers come with "all" only
    rows = bench.rows_for("adamw", ["fused"], peers="all", state_bits=(8, 4))
    rows = [r for r in rows if r.label != "torch compiled foreach"]  # compiles for a minute; counts as torch's
    assert {r.label: r.state_bits for r in rows} == {
        "fastoptim fused": 32, "fastoptim fused 8-bit state": 8, "fastoptim fused 4-bit state": 4, "torch loop": 32,
        "torch foreach": 32, "torch fused": 32, "shared-map AdamW8bit": 8, "compiling AdamW4bit": 4,
        "flat floor": 32}
    shapes = bench.shapes_for("gpt", 300_000)
    bench.run_workload(shapes, rows, rounds=1, steps_per_round=1, warmup=0)
    n = bench.numel(shapes)
    result = json.loads(json.dumps(bench.to_dict("gpt", "adamw", n, len(shapes), rows)))  # as --json writes it
    by_label = {r["label"]: r for r in result["rows"]}
    expected = {"fastoptim fused": 8 * n, "torch fused": 8 * n, "flat floor": 8 * n,
                "shared-map AdamW8bit": 2 * n + 256 * 4, "compiling AdamW4bit": 2 * n + 256 * 4,
                "fastoptim fused 8-bit state": _quantized_state_bytes(shapes, 8),
                "fastoptim fused 4-bit state": _quantized_state_bytes(shapes, 4)}
    for label, state_bytes in expected.items():
        row = by_label[label]
        assert row["error"] is None and row["state_bits"] == {r.label: r.state_bits for r in rows}[label]
        assert row["state_bytes"] == state_bytes, (label, row["state_bytes"], state_bytes)
        assert row["state_bytes_per_param"] == state_bytes / n


def test_curves_runs_flat_levels_at_low_widths(tmp_path):
    """A flat level at 8 bits is a run of its own beside the flat 32-bit one, and it draws the non-flat 8-bit
    curve (the quantized states are the same bits; the plain tail agrees to fp32 rounding)."""
    out_json = tmp_path / "c.json"
    assert main(["curves", "-o", "adamw", "--impl", "fused", "--flat", "fused", "--steps", "12", "--state-bits", "8",
                 "--rounding", "stochastic", "--out", str(tmp_path / "c.png"), "--json", str(out_json)]) == 0
    data = json.loads(out_json.read_text())
    gaps = {d["curve"]: d for d in data["precision_gaps"]}
    assert set(gaps) == {"fused 8-bit state", "fused flat 8-bit state", "fused bf16 params, stochastic"}
    assert gaps["fused flat 8-bit state"]["reference"] == "fused flat"
    losses = {c["curve"]: c["losses"] for c in data["curves"]}
    assert losses["fused flat 8-bit state"] != losses["fused flat"]
    assert max(abs(a - b) for a, b in zip(losses["fused flat 8-bit state"], losses["fused 8-bit state"])) < 1e-5


def test_bench_state_format_names_its_rows_as_state_bits_does(tmp_path):
    """``--state-format`` takes the formats by name (an alias too) and makes the rows ``--state-bits`` makes for
    the same formats; the JSON config names both spellings."""
    runs = {}
    for flags in (["--state-format", "bf16", "int8"], ["--state-bits", "16", "8"]):
        out_json = tmp_path / f"{flags[0]}.json"
        assert main(["bench", "--quick", "-w", "gpt", "--params", "300k", "--impl", "fused", "--flat",
                     *flags, "--peers", "none", "--no-schedulers", "--json", str(out_json)]) == 0
        runs[flags[0]] = json.loads(out_json.read_text())
    for data in runs.values():
        assert (data["config"]["state_format"], data["config"]["state_bits"]) == (["bf16", "dynamic8"], [16, 8])
    by_name, by_bits = ({r["label"]: r for r in data["results"][0]["rows"]} for data in runs.values())
    assert set(by_name) == set(by_bits) == {"fastoptim fused", "fastoptim fused 16-bit state",
                                             "fastoptim fused 8-bit state", "flat floor"}
    for label, row in by_name.items():
        assert row["error"] is None and (row["state_bits"], row["state_bytes"]) == (
            by_bits[label]["state_bits"], by_bits[label]["state_bytes"])


def test_state_format_and_state_bits_must_agree(capsys):
    from fastoptim.cli import build_parser

    args = build_parser().parse_args(["bench", "--state-bits", "8", "4", "--state-format", "dynamic4", "int8"])
    assert (args.state_bits, args.state_format) == ([8, 4], ["dynamic4", "int8"])  # the same formats: fine
    for argv in (["bench", "--state-bits", "8", "--state-format", "bf16"],
                 ["bench", "--state-format", "int8", "int4", "--state-bits", "8"],
                 ["train", "--state-format", "int8", "--state-bits", "16"]):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(argv)
        assert e.value.code == 2 and "name different state formats" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--state-format", "fp7"])
    assert "invalid choice: 'fp7'" in capsys.readouterr().err


class _FP16(Codec):
    """fp16 state, a format fastoptim does not ship (no kernel hooks: it runs staged)."""
    name, bits = "fp16-curves-test", 16

    def format_for(self, p, state, min_quant_size, unsigned_states):
        return PLAIN if not p.is_floating_point() else self.format()

    def make(self, p, fmt, value):
        return torch.full_like(p, value, dtype=torch.float16, memory_format=torch.contiguous_format)

    def tensor_dtype(self, param_dtype):
        return torch.float16


@pytest.fixture
def fp16():
    codec = codecs.register(_FP16())
    yield codec
    codecs.unregister(codec)


def test_curves_takes_state_formats_by_name_as_bench_does(tmp_path, fp16):
    """``--state-format`` by name or alias runs what ``--state-bits`` runs, and a format registered beside the
    built-in ones is a choice as soon as it is registered."""
    runs = {}
    for flags in (["--state-format", "int8", fp16.name], ["--state-bits", "8"]):
        out_json = tmp_path / f"{flags[0]}.json"
        assert main(["curves", "-o", "adamw", "--impl", "fused", "--flat", "--steps", "4", *flags,
                     "--out", str(tmp_path / "c.png"), "--json", str(out_json)]) == 0
        runs[flags[0]] = json.loads(out_json.read_text())
    by_name, by_bits = runs["--state-format"], runs["--state-bits"]
    assert (by_name["state_format"], by_name["state_bits"]) == (["dynamic8", fp16.name], [8, fp16.name])
    assert (by_bits["state_format"], by_bits["state_bits"]) == (["dynamic8"], [8])
    named = {c["curve"]: c for c in by_name["curves"]}
    assert named["fused 8-bit state"]["losses"] == next(
        c["losses"] for c in by_bits["curves"] if c["curve"] == "fused 8-bit state")
    custom = named[f"fused {fp16.name} state"]
    assert custom["state_bits"] == fp16.name and custom["losses"] != named["fused"]["losses"]
