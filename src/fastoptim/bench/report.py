"""The bench's table and JSON. The JSON schema is documented in docs/bench.md ("Bench JSON")."""

from __future__ import annotations

import json
import math
import platform
from typing import Any

import torch

from .. import registry
from .runner import ADAMW_LABEL, Row

SCHEMA_VERSION = 1
# HBM bandwidth, bytes/s, for the paper estimate of a GPU step
GPU_BANDWIDTH = {"H100": 3.35e12, "A100": 2.0e12}


def bytes_per_param(optimizer: str, param_bytes: int = 4, state_bytes: int = 4) -> int:
    """Bytes a memory-bound step moves per param: read p and g, write p; read and write every state."""
    from .runner import full_size_states

    spec = registry.get(optimizer)
    n_state = full_size_states(spec, spec.option_sets[0]) + len(spec.cls.rule.scratch)  # (scratch: written, read)
    return 3 * param_bytes + 2 * n_state * state_bytes


def ratios(rows: list[Row]) -> tuple[float, float]:
    floor = next((r.median_ms for r in rows if r.label == "flat floor"), math.nan)
    fused = next((r.median_ms for r in rows if r.label.startswith("torch fused")), math.nan)
    return floor, fused


def _newton_schulz(matmul: dict, rows: list[Row]) -> dict[str, Any]:
    """``matmul`` with each Newton-Schulz row's method, FLOPs (``Row.flops``), achieved rate and time over the
    AdamW row's (``runner.ADAMW_LABEL``: fused AdamW on the same params)."""
    adamw = next((r for r in rows if r.label.startswith(ADAMW_LABEL) and not r.error), None)
    adamw_ms = adamw.median_ms if adamw else math.nan

    def rate(r):
        gflops = r.flops / r.median_ms / 1e6
        return {"method": r.method, "flops_per_step": r.flops, "gflops": gflops,
                "of_gemm_rate": gflops / matmul["gemm_gflops"],
                "vs_adamw": r.median_ms / adamw_ms if adamw_ms == adamw_ms else None}

    # the fused level with the default settings: the first such row (the method rows follow the levels')
    fused = next((r for r in rows if r.impl == "fused" and r.flops is not None and not r.error), None)
    return {**matmul, "adamw_row": _label(adamw) if adamw else None, "adamw_ms": adamw.median_ms if adamw else None,
            "fused_row": _label(fused) if fused else None,
            "rows": {_label(r): rate(r) for r in rows if not r.error and r.flops is not None}}


def to_dict(workload: str, optimizer: str, n_params: int, n_tensors: int, rows: list[Row],
            matmul: dict | None = None) -> dict[str, Any]:
    """``matmul``: for Muon's family, the Newton-Schulz FLOPs per step with the default settings and the measured
    GEMM rate on its matrices; each row that runs Newton-Schulz then gets its own FLOPs (``Row.flops``), its
    achieved rate and its time over fused AdamW's on the same params."""
    floor, fused = ratios(rows)
    bpp = bytes_per_param(optimizer)
    return {
        "newton_schulz": None if matmul is None else _newton_schulz(matmul, rows),
        "workload": workload, "optimizer": optimizer, "params": n_params, "tensors": n_tensors,
        "bytes_per_param": bpp,
        "gpu_estimate_ms": {gpu: bpp * n_params / bw * 1e3 for gpu, bw in GPU_BANDWIDTH.items()},
        "rows": [{
            "label": _label(r), "library": r.library, "impl": r.impl, "flat": r.flat, "paths": r.paths,
            "median_ms": r.median_ms, "min_ms": r.spread_ms[0], "max_ms": r.spread_ms[1],
            "samples": len(r.times_ms), "first_step_ms": r.first_step_ms, "state_mib": r.state_bytes / 2 ** 20,
            "state_bits": r.state_bits, "state_bytes": r.state_bytes,
            "state_bytes_per_param": None if r.error else r.state_bytes / n_params,
            "peak_bytes": r.peak_bytes, "peak_mib": None if r.peak_bytes is None else r.peak_bytes / 2 ** 20,
            "vs_torch_fused": r.median_ms / fused if fused == fused else None,
            "vs_flat_floor": r.median_ms / floor if floor == floor else None,
            "error": r.error,
        } for r in rows],
    }


# the paths each level runs as its own (the fused level picks among several by device and dtype)
# (per-tensor stages: the loop level runs them one tensor at a time, foreach and fused batched, compiled compiled)
OWN_PATHS = {"loop": {"loop", "stage_loop"}, "foreach": {"foreach", "stage_batched"},
             "compiled": {"compiled", "stage_compiled"},
             "fused": {"triton", "triton_stored", "torch_fused", "cpu_kernel", "compiled", "foreach", "stage_batched"}}


def _label(row) -> str:
    """A fastoptim row whose level routed itself to another level's path says which paths ran."""
    own = OWN_PATHS.get(row.impl.split("+")[0])
    if row.library == "fastoptim" and own is not None and set(row.paths) - own:
        return f"{row.label} (ran {' + '.join(row.paths)})"
    return row.label


def cpu_name() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo), else what the platform says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment() -> dict[str, Any]:
    """Where the bench ran. ``cpu_kernel_simd_bits``: the width the CPU kernel's codec runs at here (512: AVX-512,
    256: AVX2, 0: scalar, None: no kernel builds), which sets the speed of 16/8/4-bit state on the CPU."""
    from ..paths.cpu_kernel import kernels as cpu_kernels

    return {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
            "cpu": cpu_name(), "cpu_kernel_simd_bits": cpu_kernels.simd_width(), "threads": torch.get_num_threads()}


def environment_line(env: dict[str, Any]) -> str:
    simd = {512: "AVX-512", 256: "AVX2", 0: "scalar", None: "none (no C++ compiler)"}[env["cpu_kernel_simd_bits"]]
    return (f"{env['cpu']} ({env['machine']}), {env['threads']} threads, torch {env['torch']}; "
            f"CPU kernel build: {simd}")


def write_json(path: str, results: list[dict], config: dict, schedulers: list[dict] | None = None) -> None:
    with open(path, "w") as f:
        json.dump({"schema_version": SCHEMA_VERSION, "environment": environment(), "config": config,
                   "results": results, "schedulers": schedulers or []}, f, indent=2)


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None or x != x else format(x, spec)


def table_rows(result: dict) -> list[list[str]]:
    ns = result.get("newton_schulz")
    width = len(columns(result))

    def row(r):
        cells = [r["label"], _fmt(r["median_ms"], ".2f"), f"{_fmt(r['min_ms'], '.2f')}-{_fmt(r['max_ms'], '.2f')}",
                 _fmt(r["vs_torch_fused"], ".2f"), _fmt(r["vs_flat_floor"], ".2f"), _fmt(r["state_mib"], ".1f"),
                 _fmt(r["state_bytes_per_param"], ".3f"), _fmt(r["peak_mib"], ".1f"), _fmt(r["first_step_ms"], ".1f")]
        if ns:
            rate = ns["rows"].get(r["label"], {})
            cells += [_fmt(rate.get("flops_per_step", math.nan) / 1e9, ".3g"), _fmt(rate.get("gflops"), ".1f"),
                      _fmt(rate.get("vs_adamw"), ".1f")]
        return cells

    return [[r["label"], f"error: {r['error']}"] + [""] * (width - 2) if r["error"] else row(r)
            for r in result["rows"]]


# peak over p+g: tensor bytes live beyond the params and grads while the optimizer is built and takes its first step
HEADERS = ["row", "ms/step", "spread", "x torch fused", "x flat floor", "state MiB", "state B/param",
           "peak over p+g MiB", "first step ms"]
# Muon's family: each row's Newton-Schulz FLOPs (its method's), the rate it reached, its time over fused AdamW's
NS_HEADERS = ["NS GFLOP/step", "GFLOP/s", "x AdamW fused"]


def columns(result: dict) -> list[str]:
    return HEADERS + NS_HEADERS if result.get("newton_schulz") else HEADERS


def title(result: dict) -> str:
    est = ", ".join(f"{gpu} {ms:.3f} ms" for gpu, ms in result["gpu_estimate_ms"].items())
    text = (f"{result['optimizer']} on {result['workload']}: {result['params'] / 1e6:.1f}M params in "
            f"{result['tensors']} tensors; GPU estimate at {result['bytes_per_param']} B/param: {est}")
    ns = result.get("newton_schulz")
    if ns:
        best = max(ns["rows"].items(), key=lambda kv: kv[1]["gflops"], default=None)
        text += (f"\nNewton-Schulz {ns['flops_per_step'] / 1e9:.3g} GFLOP/step ({ns['dtype']}, {ns['method']}); "
                 f"measured GEMM rate on these matrices {ns['gemm_gflops']:.1f} GFLOP/s")
        if best:
            text += f"; best row {best[0]}: {best[1]['gflops']:.1f} GFLOP/s = {best[1]['of_gemm_rate']:.0%} of it"
        if ns["adamw_row"] is not None and ns["fused_row"] is not None:
            text += (f"\n{ns['adamw_row']} on the same params {ns['adamw_ms']:.2f} ms/step; {ns['fused_row']} "
                     f"{ns['rows'][ns['fused_row']]['vs_adamw']:.1f}x that")
    return text


SCHEDULER_HEADERS = ["scheduler", "us/step", "spread"]


def scheduler_rows(schedulers: list[dict]) -> list[list[str]]:
    return [[s["label"], f"{s['us_per_step']:.2f}", f"{s['min_us']:.2f}-{s['max_us']:.2f}"] for s in schedulers]


def print_tables(results: list[dict], schedulers: list[dict] | None = None) -> None:
    tables = [(title(r), columns(r), table_rows(r)) for r in results]
    if schedulers:
        tables.append(("scheduler step overhead (AdamW, 2 param groups)", SCHEDULER_HEADERS,
                       scheduler_rows(schedulers)))
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        for name, headers, rows in tables:
            print(name)
            print("  ".join(headers))
            for row in rows:
                print("  ".join(row))
            print()
        return
    console = Console()
    # the tables' natural width, also when piped (Muon's family has three more columns)
    console.width = max(console.width, max((20 * (len(h) - len(HEADERS)) + 150 for _, h, _ in tables), default=150))
    for name, headers, rows in tables:
        table = Table(title=name)
        for i, h in enumerate(headers):
            table.add_column(h, justify="left" if i == 0 else "right")
        for row in rows:
            table.add_row(*row)
        console.print(table)


def markdown(results: list[dict], schedulers: list[dict] | None = None) -> str:
    out = []
    for result in results:
        out += [f"**{title(result)}**", "", "| " + " | ".join(columns(result)) + " |",
                "|" + "---|" * len(columns(result))]
        out += ["| " + " | ".join(row) + " |" for row in table_rows(result)]
        out.append("")
    if schedulers:
        out += ["**scheduler step overhead (AdamW, 2 param groups)**", "",
                "| " + " | ".join(SCHEDULER_HEADERS) + " |", "|---|---|---|"]
        out += ["| " + " | ".join(row) + " |" for row in scheduler_rows(schedulers)]
        out.append("")
    return "\n".join(out)
