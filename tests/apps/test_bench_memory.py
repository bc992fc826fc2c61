"""The bench's peak memory above params and grads: a measurement (the profiler's live tensor bytes on the CPU, the
allocator's peak on CUDA), in each row, its JSON and its table."""

import json

import torch

from fastoptim import bench
from fastoptim.bench import memory, report, runner
from fastoptim.cli import main

MiB = 2 ** 20


def _floats(mib: float) -> torch.Tensor:
    return torch.empty(int(mib * MiB) // 4)


def test_each_stretch_counts_its_own_peak_above_what_was_live_as_it_began():
    with memory.PeakMemory("cpu") as probe:
        held = [_floats(4)]  # made before the stretches: not counted, but its free is seen
        with probe.measure("grow"):
            scratch = _floats(3)
            del scratch
            held.append(_floats(1))
        with probe.measure("free first"):
            held.clear()  # -5 MiB, then +2: never above where it began
            held.append(_floats(2))
        with probe.measure("then free"):  # +0.5 MiB, -2, +0.25
            held.append(_floats(0.5))
            del held[0]
            held.append(_floats(0.25))
    assert probe.peaks == {"grow": 3 * MiB, "free first": 0, "then free": MiB // 2}


def test_a_cycle_left_by_earlier_code_is_not_freed_against_a_stretch():
    """The collector is off inside the probe: earlier garbage is not freed in the middle of a stretch, where its
    free would hide what the stretch itself allocated."""
    with memory.PeakMemory("cpu") as probe:
        with probe.measure("leaves garbage"):
            cycle = {"tensor": _floats(4)}
            cycle["self"] = cycle
            del cycle
        with probe.measure("allocates"):
            objects = [[] for _ in range(50_000)]  # enough new objects that the collector would run here
            held = _floats(3)
    assert probe.peaks["allocates"] == 3 * MiB and len(objects) and held.numel()


def test_on_cuda_the_peak_is_the_allocators_above_its_count_as_the_stretch_began(monkeypatch):
    """The CUDA branch's arithmetic, with the allocator's counters stood in (the CPU runs this test too)."""
    calls, counters = [], {"allocated": 100, "peak": 100}

    def reset(device):
        calls.append("reset")
        counters["peak"] = counters["allocated"]

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("sync"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: counters["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: counters["peak"])
    counters["peak"] = 10_000  # an earlier peak: the reset forgets it
    with memory.PeakMemory("cuda") as probe:
        with probe.measure("step"):
            counters["peak"], counters["allocated"] = 450, 300
    assert probe.peaks == {"step": 350} and calls == ["sync", "reset", "sync"]


SHAPES = [(256, 256), (512, 256), (256,)]  # 2-D ones of 4096+ elements: 8-bit state quantizes them


def test_every_row_reports_its_peak_and_it_holds_at_least_its_state():
    rows = bench.rows_for("adamw", ["fused"], peers="torch", state_bits=(8,))
    bench.run_workload(SHAPES, rows, rounds=1, steps_per_round=1, warmup=0)
    n = bench.numel(SHAPES)
    by_label = {r.label: r for r in rows}
    assert set(by_label) == {"fastoptim fused", "fastoptim fused 8-bit state", "torch loop", "torch foreach",
                             "torch fused", "flat floor"}
    for label, row in by_label.items():  # the state is made in the stretch and still live at its end
        assert row.error is None and row.peak_bytes is not None and row.peak_bytes >= row.state_bytes, label
    for label, row in by_label.items():
        if row.state_bits == 32:  # fp32 AdamW: exp_avg and exp_avg_sq, 4 bytes each; a step's temporaries on top
            # stay below another copy of params and grads
            assert 2 * 4 * n <= row.peak_bytes < 2 * 4 * n + 8 * n, (label, row.peak_bytes)
    fused = by_label["torch fused"]  # one kernel in place: the state, its 0-d step counts and little more
    assert fused.peak_bytes <= fused.state_bytes + 4096
    foreach = by_label["torch foreach"]  # its foreach ops make whole lists of temporaries (one is 4 B/param)
    assert foreach.peak_bytes > foreach.state_bytes + 2 * n
    low = by_label["fastoptim fused 8-bit state"]  # (its temporaries are not bounded here)
    assert low.state_bits == 8 and low.state_bytes < 8 * n / 3 and low.peak_bytes > 0


class _SecondInstanceFails:
    built = 0

    def __init__(self, params):
        type(self).built += 1
        if type(self).built > 1:
            raise RuntimeError("one instance only")
        self.opt = torch.optim.SGD(params, lr=0.1)
        self.state = self.opt.state

    def step(self):
        self.opt.step()


def test_a_row_that_cannot_be_measured_shows_no_number():
    row = runner.Row("once only", "test", "loop", _SecondInstanceFails)
    bench.run_workload(SHAPES, [row], rounds=1, steps_per_round=1, warmup=0)
    assert row.error is None and row.times_ms and row.peak_bytes is None  # timed, not measured
    result = json.loads(json.dumps(bench.to_dict("w", "sgd", bench.numel(SHAPES), len(SHAPES), [row])))
    assert (result["rows"][0]["peak_bytes"], result["rows"][0]["peak_mib"]) == (None, None)
    (cells,) = report.table_rows(result)
    assert cells[report.HEADERS.index("peak over p+g MiB")] == "-"


def test_bench_json_and_table_carry_the_peak(tmp_path, capsys):
    out_json, out_md = tmp_path / "b.json", tmp_path / "b.md"
    assert main(["bench", "--quick", "-w", "gpt", "--params", "300k", "--impl", "fused", "--flat",
                 "--state-format", "dynamic8", "--peers", "torch", "--no-schedulers", "--threads", "1",
                 "--json", str(out_json), "--markdown", str(out_md)]) == 0
    result = json.loads(out_json.read_text())["results"][0]
    rows = {r["label"]: r for r in result["rows"]}
    for label, row in rows.items():
        assert row["peak_bytes"] >= row["state_bytes"] and row["peak_mib"] == row["peak_bytes"] / MiB, label
    assert rows["torch fused"]["peak_bytes"] >= 8 * result["params"]
    assert rows["fastoptim fused 8-bit state"]["peak_mib"] > 0
    header = "| " + " | ".join(report.HEADERS) + " |"
    assert "| state B/param | peak over p+g MiB | first step ms |" in header and header in out_md.read_text()
    cell = report.table_rows(result)[list(rows).index("torch fused")][report.HEADERS.index("peak over p+g MiB")]
    assert cell == f"{rows['torch fused']['peak_mib']:.1f}" and "peak over p+g" in capsys.readouterr().out
