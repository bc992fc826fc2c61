"""The Triton kernels, proven without a GPU: run in Triton's interpreter on CPU tensors against the loop
level (each test asserting, through ``record_paths``, that the kernel ran), and compiled ahead of time for
sm_80 and sm_90 with the PTX read for 128-bit vector access and for the arithmetic the rules mean: IEEE
division and square root, no FMA contraction, 16-bit stores rounded to nearest."""

import ast
import inspect
import itertools
import re

import pytest
import torch

pytest.importorskip("triton")

from conftest import (ELEMENTWISE, ELEMENTWISE_CASES, assert_params_close, assert_state_close, clone_params,  # noqa: E402
                      make_params, pairwise_with, same_random_grads, set_grads)
from fastoptim.levels import record_paths  # noqa: E402
from fastoptim.paths.triton import kernels as tk  # noqa: E402
from fastoptim.registry import OPTIMIZERS  # noqa: E402

# Kernel tests: the elementwise kernels run a rule's ``update``, which staged rules (Muon, Adafactor) do not have:
# they never run these kernels, and their stages are tested in tests/paths/test_stages.py. Hence ELEMENTWISE here.


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _assert_same(ours, base, ours_p, base_p, step):
    for i, (a, b) in enumerate(zip(ours_p, base_p)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=lambda m: f"step {step}, param {i}: {m}")
        for k, v in base.state[b].items():
            if isinstance(v, torch.Tensor):
                assert_state_close(ours.state[a][k], v, msg=f"step {step}, param {i}, state {k}")


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 4 blocks instead of 64: a tensor spans several chunks at a tenth of the size (the interpreter
    runs the block loop in Python). The same code: ``CHUNK`` is read at each launch, by the table's chunk list
    and by the kernel's constexpr, and a real GPU launch keeps its own."""
    monkeypatch.setattr(tk, "CHUNK", 4 * tk.BLOCK)


@pytest.mark.parametrize("name,index", ELEMENTWISE_CASES)
def test_interpreted_kernel_matches_loop_level_every_step(interpret, small_chunks, name, index):
    spec = OPTIMIZERS[name]
    opts = spec.option_sets[index]
    base_p = make_params(name=name)
    ours_p = clone_params(base_p)
    # one tensor spans several chunks (full blocks in each) and ends mid-block; the others are tiny, empty, 0-d,
    # strided
    for params in (base_p, ours_p):
        params.append(torch.nn.Parameter(torch.linspace(-1, 1, tk.CHUNK + 3 * tk.BLOCK + 7)))
    base = spec.cls(base_p, impl="loop", **opts)
    ours = spec.cls(ours_p, impl="fused", **opts)
    for step in range(1, 6):
        set_grads(step, [base_p, ours_p])
        base.step()
        with record_paths() as paths:
            ours.step()
        # the kernel ran; the transposed param (and its grad) went to the foreach level, nothing else did
        assert "triton" in paths and "foreach" in paths and set(paths) == {"triton", "foreach"}, paths
        _assert_same(ours, base, ours_p, base_p, step)
    table = next(c["triton_table"] for c in ours._stepper.caches().values() if "triton_table" in c)
    long_row = table.table[:, 0].tolist().index(tk.CHUNK + 3 * tk.BLOCK + 7)
    starts = [start for row, start in table.chunks.tolist() if row == long_row]
    assert starts == [0, tk.CHUNK]  # two programs over the long tensor: a full chunk, then 3 blocks and a tail


@pytest.mark.slow
def test_thousands_of_tensors_in_one_launch(interpret):
    g = torch.Generator().manual_seed(0)
    sizes = torch.randint(0, 300, (1500,), generator=g).tolist()
    base_p = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in sizes]
    ours_p = clone_params(base_p)
    base = OPTIMIZERS["adamw"].cls(base_p, impl="loop", lr=1e-2, amsgrad=True)
    ours = OPTIMIZERS["adamw"].cls(ours_p, impl="fused", lr=1e-2, amsgrad=True)
    for step in range(1, 3):
        same_random_grads(base_p, ours_p, g)
        base.step()
        with record_paths() as paths:
            ours.step()
        assert paths == ["triton"]  # one bucket, one launch, no tensor left out
        _assert_same(ours, base, ours_p, base_p, step)
    table = next(iter(ours._stepper.caches().values()))["triton_table"]
    assert table.n_chunks == sum(1 for n in sizes if n > 0)  # one launch covered every non-empty tensor


def test_interpreter_patches_triton_language_once_per_launch(interpret, monkeypatch):
    """The twin and its primitives are device functions: called once per block, they run under the patches
    the launch made (Triton's own device call would patch ``triton.language`` again each time). Same
    numbers as the loop level."""
    from triton.runtime import interpreter

    patches = []
    real = interpreter._patch_lang
    monkeypatch.setattr(interpreter, "_patch_lang", lambda fn: patches.append(fn.__name__) or real(fn))
    base_p = [torch.nn.Parameter(torch.randn(n)) for n in (3 * tk.BLOCK + 5, 40, 7)]
    ours_p = clone_params(base_p)
    base = OPTIMIZERS["adamw"].cls(base_p, impl="loop", lr=1e-2, amsgrad=True)  # the twin calls maximum, sqrt
    ours = OPTIMIZERS["adamw"].cls(ours_p, impl="fused", lr=1e-2, amsgrad=True)
    for step in range(1, 3):
        set_grads(step, [base_p, ours_p], none_every=10 ** 9)
        base.step()
        patches.clear()
        with record_paths() as paths:
            ours.step()
        assert paths == ["triton"]
        assert patches == ["adam_update_multi_tensor_111"], patches  # the launch's, none per call
        _assert_same(ours, base, ours_p, base_p, step)


def test_flat_buffer_runs_one_kernel_over_the_bucket(interpret):
    base_p = make_params()
    ours_p = clone_params(base_p)
    base = OPTIMIZERS["lion"].cls(base_p, impl="loop", lr=1e-2, weight_decay=0.1)
    ours = OPTIMIZERS["lion"].cls(ours_p, impl="fused", flat=True, lr=1e-2, weight_decay=0.1)
    for step in range(1, 4):
        set_grads(step, [base_p, ours_p], none_every=10 ** 9)
        base.step()
        with record_paths() as paths:
            ours.step()
        assert paths == ["triton"]  # the flat buffer is contiguous and aligned: nothing falls back
        _assert_same(ours, base, ours_p, base_p, step)


def test_misaligned_and_strided_tensors_take_the_safe_path(interpret):
    storage = torch.randn(1001)
    params = [torch.nn.Parameter(storage[1:1001]), torch.nn.Parameter(torch.randn(40, 3).t()),
              torch.nn.Parameter(torch.randn(64))]
    assert params[0].data_ptr() % tk.ALIGN != 0 and not params[1].is_contiguous()
    base_p = clone_params(params)
    ours = OPTIMIZERS["adam"].cls(params, impl="fused", lr=1e-2)
    base = OPTIMIZERS["adam"].cls(base_p, impl="loop", lr=1e-2)
    for step in range(1, 3):
        set_grads(step, [params, base_p], none_every=10 ** 9)
        with record_paths() as paths:
            ours.step()
        assert paths == ["triton", "foreach"]  # the aligned param in the kernel, the other two after it
        base.step()
        _assert_same(ours, base, params, base_p, step)
    table = next(iter(ours._stepper.caches().values()))["triton_table"]
    assert table.fallback == [0, 1]


def test_table_is_cached_until_an_address_changes(interpret):
    params = make_params()
    opt = OPTIMIZERS["sgd"].cls(params, impl="fused", lr=0.1, momentum=0.9)
    set_grads(1, [params], none_every=10 ** 9)
    with record_paths() as paths:
        opt.step()
        table = next(iter(opt._stepper.caches().values()))["triton_table"]
        first = table.table
        opt.step()  # same grads, same addresses
        assert table.table is first
        set_grads(2, [params], none_every=10 ** 9)  # new grad tensors: new addresses
        opt.step()
        assert table.table is not first
    assert paths.count("triton") == 3  # the kernel ran each step (the transposed param beside it)


@pytest.mark.parametrize("name,index", ELEMENTWISE_CASES)
def test_kernel_unscales_and_skips_with_amp_tensors(interpret, name, index):
    """The grad multiplier (1/scale) and found_inf are read inside the kernel: no host sync."""
    spec = OPTIMIZERS[name]
    rule = spec.cls.rule
    group = {**rule.defaults, **spec.option_sets[index]}
    active = rule.active(group)
    g = torch.Generator().manual_seed(index)
    shapes = [(3000,), (7,), (65, 3)]
    params = [torch.randn(s, generator=g) for s in shapes]
    grads = [torch.randn(s, generator=g) for s in shapes]
    states = [[torch.rand(s, generator=g) for s in shapes] if on else None for on in active]
    scale = torch.tensor(1024.0)
    scaled = [gr * scale for gr in grads]
    scalars, flags = rule.scalars(group, 3, *rule.host_start(group)), rule.flags(group)

    ref_p = [p.clone() for p in params]
    ref_s = [None if s is None else [t.clone() for t in s] for s in states]
    from fastoptim.paths import loop
    loop.apply(rule.update, ref_p, grads, ref_s, scalars, flags)

    before = ([p.clone() for p in params], [None if s is None else [t.clone() for t in s] for s in states])
    with record_paths() as paths:
        tk.run(rule.update, rule.state_names, params, scaled, states, scalars, flags, tk.TensorTable(),
               grad_mul=1 / scale, found_inf=torch.tensor(1.0))
    assert paths == ["triton"]  # launched, and skipped inside the kernel
    for a, b in zip(params, before[0]):
        assert torch.equal(a, b)  # inf seen: params untouched
    for s, b in zip(states, before[1]):
        if s is not None:
            assert all(torch.equal(x, y) for x, y in zip(s, b))

    with record_paths() as paths:
        tk.run(rule.update, rule.state_names, params, scaled, states, scalars, flags, tk.TensorTable(),
               grad_mul=1 / scale, found_inf=torch.tensor(0.0))
    assert paths == ["triton"]
    for a, b in zip(params, ref_p):  # random states can make centered RMSprop's variance negative: NaN alike
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, equal_nan=True)


# --- ahead-of-time compile for real GPUs --------------------------------------------------------------

def _group_patterns():
    """Every rule with each distinct (active states, flags) pattern of its registry option sets."""
    seen, out = set(), []
    for name, index in ELEMENTWISE_CASES:
        spec = OPTIMIZERS[name]
        rule = spec.cls.rule
        group = {**rule.defaults, **spec.option_sets[index]}
        key = (rule.update, rule.active(group), rule.flags(group))
        if key not in seen:
            seen.add(key)
            out.append((name, index))
    return out


def _count(ptx: str, pattern: str) -> int:
    return len(re.findall(pattern, ptx))


def _rule_uses(rule):
    """(divides, takes a root): read from the rule's own source, the one every level runs."""
    tree = ast.parse(inspect.getsource(rule.update).lstrip())
    divides = any(isinstance(n, (ast.BinOp, ast.AugAssign)) and isinstance(n.op, ast.Div) for n in ast.walk(tree))
    roots = any(isinstance(n, ast.Call) and getattr(n.func, "id", None) == "sqrt" for n in ast.walk(tree))
    return divides, roots


def _assert_ieee_arithmetic(ptx: str, rule) -> None:
    """The GPU computes what the rule means, as the interpreter and the torch levels do: IEEE division and
    square root (Triton's own ``/`` is the approximate ``div.full.f32``), no fused multiply-add."""
    divides, roots = _rule_uses(rule)
    assert _count(ptx, r"\bdiv\.full\.") == 0 and _count(ptx, r"\bdiv\.approx\.") == 0
    assert _count(ptx, r"\brcp\.approx\.") == 0 and _count(ptx, r"\bsqrt\.approx\.") == 0
    assert (_count(ptx, r"\bdiv\.rn\.f32\b") > 0) == divides
    assert (_count(ptx, r"\bsqrt\.rn\.f32\b") > 0) == roots
    assert _count(ptx, r"\bfma\.\w+\.f32\b") == 0


def _assert_16bit_stores_round_to_nearest(ptx: str, dtype: torch.dtype) -> None:
    """Every fp32 -> 16-bit conversion (scalar or packed pair) rounds to nearest even: ``cvt.rn``."""
    kind = {torch.bfloat16: "bf16", torch.float16: "f16"}[dtype]
    downcasts = re.findall(rf"\bcvt((?:\.\w+)*)\.(?:bf16|f16)(?:x2)?\.f32\b", ptx)
    assert downcasts, "no fp32 -> 16-bit conversion found"
    assert all(mods == ".rn" for mods in downcasts), sorted(set(downcasts))
    assert _count(ptx, rf"\bcvt\.rn\.{kind}(x2)?\.f32\b") == len(downcasts)


# fp32: BLOCK elements over 32 * NUM_WARPS threads, 4 per 128-bit access
VECTORS_PER_ARRAY = tk.BLOCK // (32 * tk.NUM_WARPS * 4)


@pytest.mark.sample("name", "capability")
@pytest.mark.parametrize("name,index,capability", pairwise_with(_group_patterns(), (90, 80)))
def test_kernel_compiles_for_gpu_with_vector_access(name, index, capability):
    spec = OPTIMIZERS[name]
    rule = spec.cls.rule
    group = {**rule.defaults, **spec.option_sets[index]}
    n_states = sum(rule.active(group))
    compiled = tk.compile_for_gpu(rule, group, torch.float32, capability)
    ptx = compiled.asm["ptx"]
    assert f".target sm_{capability}" in ptx and len(compiled.asm["cubin"]) > 0
    # the unmasked body: p, g and each state read with 128-bit loads; p and each state written back
    assert _count(ptx, r"ld\.global(\.\w+)*\.v4\.b32") == (2 + n_states) * VECTORS_PER_ARRAY
    assert _count(ptx, r"st\.global(\.\w+)*\.v4\.b32") == (1 + n_states) * VECTORS_PER_ARRAY
    _assert_ieee_arithmetic(ptx, rule)


def test_adamw_fp32_is_four_loads_three_stores_per_element_group():
    rule = OPTIMIZERS["adamw"].cls.rule
    ptx = tk.compile_for_gpu(rule, dict(rule.defaults), torch.float32, 90).asm["ptx"]
    loads = _count(ptx, r"ld\.global(\.\w+)*\.v4\.b32")
    stores = _count(ptx, r"st\.global(\.\w+)*\.v4\.b32")
    assert (loads // VECTORS_PER_ARRAY, stores // VECTORS_PER_ARRAY) == (4, 3)


def test_twin_divides_with_div_rn_and_the_rule_keeps_its_operator():
    """The Triton twin is the rule's own source with each ``/`` spelled ``tl.div_rn``; the rule itself (what
    the loop, foreach and compiled levels run) is untouched."""
    for name in ELEMENTWISE:
        update = OPTIMIZERS[name].cls.rule.update
        twin = tk.twin_source(update)
        original = ast.parse(inspect.getsource(update).lstrip())
        rewritten = ast.parse(twin)
        n_div = sum(isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div) for n in ast.walk(original))
        assert sum(isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div) for n in ast.walk(rewritten)) == 0
        assert twin.count("tl.div_rn(") == n_div
        assert "/" not in twin
    assert tk.triton_twin(update) is tk.triton_twin(update)  # built once per rule


@pytest.mark.sample(("dtype", "capability"))
@pytest.mark.parametrize("name,dtype,capability", pairwise_with(
    list(itertools.product(ELEMENTWISE, (torch.bfloat16, torch.float16))), (90, 80)))
def test_half_precision_kernels_round_to_nearest_with_vector_access(name, dtype, capability):
    """16-bit storage: loaded and widened exactly, computed in fp32 with IEEE division and root, stored
    with ``cvt.rn`` (the interpreter truncates fp32 -> bf16 instead: see test_triton_numerics)."""
    rule = OPTIMIZERS[name].cls.rule
    group = dict(rule.defaults)
    n_states = sum(rule.active(group))
    ptx = tk.compile_for_gpu(rule, group, dtype, capability).asm["ptx"]
    # 8 elements per 128-bit access, so half the vectors of fp32
    assert _count(ptx, r"ld\.global(\.\w+)*\.v4\.b32") == (2 + n_states) * VECTORS_PER_ARRAY // 2
    assert _count(ptx, r"st\.global(\.\w+)*\.v4\.b32") == (1 + n_states) * VECTORS_PER_ARRAY // 2
    _assert_16bit_stores_round_to_nearest(ptx, dtype)
    _assert_ieee_arithmetic(ptx, rule)


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("name", ELEMENTWISE)
def test_grad_scaler_skips_inside_the_kernel_without_reading_found_inf(interpret, monkeypatch, name, flat):
    """GradScaler's found_inf goes into the kernel; the step never reads it on the host. The skipped step is
    counted optimistically and taken back at the next step, so the run still matches torch's."""
    from runs import scaler_run
    from fastoptim.reference import reference_class, reference_kwargs

    spec = OPTIMIZERS[name]
    opts = spec.option_sets[1]
    reads = []
    real_item = torch.Tensor.item
    real_step = spec.cls.step

    def watched_step(self, *args, **kwargs):
        found_inf = getattr(self, "found_inf", None)

        def item(t):
            if t is found_inf:
                reads.append(t)
            return real_item(t)
        monkeypatch.setattr(torch.Tensor, "item", item)
        try:
            return real_step(self, *args, **kwargs)
        finally:
            monkeypatch.setattr(torch.Tensor, "item", real_item)

    monkeypatch.setattr(spec.cls, "step", watched_step)
    ours_p = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]
    ref_p = clone_params(ours_p)
    with record_paths() as paths:
        ours, ours_rec = scaler_run(lambda ps: spec.cls(ps, impl="fused", flat=flat, **opts), ours_p)
    assert paths and set(paths) == {"triton"}  # every step in the kernel: no safe path read found_inf
    _, ref_rec = scaler_run(lambda ps: reference_class(spec)(ps, **opts, **reference_kwargs(spec)), ref_p)
    assert reads == []
    before, after, _, _ = ours_rec[1]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    if spec.cls.rule.exports_step:
        assert ours.state_dict()["state"][0]["step"].item() == 3
    for (_, a, _, _), (_, b, _, _) in zip(ours_rec, ref_rec):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", ELEMENTWISE)
def test_kernel_reads_tensor_hyperparameters_from_memory(interpret, name):
    from runs import run_with_tensor_hyperparameters
    with record_paths() as paths:
        floats, tensors = run_with_tensor_hyperparameters(name, "fused")
    # both runs (floats, then tensors) launched the kernel each of their 5 steps; the transposed param
    # beside it took the foreach level
    assert paths == ["triton", "foreach"] * 10
    assert_params_close(floats, tensors)


def test_kernel_with_scalars_in_memory_keeps_vector_access():
    rule = OPTIMIZERS["adamw"].cls.rule
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import triton
    import triton.language as tl
    group = dict(rule.defaults)
    n = len(rule.scalars(group, 1))
    kernel = tk.kernel_for(rule.update, rule.state_names, rule.active(group), n, len(rule.flags(group)), False)
    sig = {"table": "*i64", "chunks": "*i64", "grad_mul": "*fp32", "found_inf": "*fp32", "scalars": "*fp32"}
    sig.update({f"c{i}": "fp32" for i in range(n)})
    consts = dict(P_DTYPE=tl.float32, CHUNK=tk.CHUNK, BLOCK=tk.BLOCK, HAS_GRAD_MUL=True, HAS_INF=True,
                  SCALARS_IN_MEMORY=True, **{f"F{i}": f for i, f in enumerate(rule.flags(group))})
    sig.update({k: "constexpr" for k in consts})
    ptx = triton.compile(ASTSource(kernel, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": tk.NUM_WARPS, "enable_fp_fusion": False}).asm["ptx"]
    assert _count(ptx, r"ld\.global(\.\w+)*\.v4\.b32") == 4 * VECTORS_PER_ARRAY
    assert _count(ptx, r"st\.global(\.\w+)*\.v4\.b32") == 3 * VECTORS_PER_ARRAY
    _assert_ieee_arithmetic(ptx, rule)


@pytest.mark.parametrize("flat", [False, True])
def test_clip_factor_applied_inside_the_kernel(interpret, flat):
    ours_p = make_params()
    ref_p = clone_params(ours_p)
    ours = OPTIMIZERS["adamw"].cls(ours_p, impl="fused", flat=flat, max_grad_norm=0.5, lr=1e-2)
    ref = torch.optim.AdamW(ref_p, lr=1e-2, foreach=False)
    for step in range(1, 4):
        set_grads(step, [ours_p, ref_p], none_every=10 ** 9)
        torch.nn.utils.clip_grad_norm_(ref_p, 0.5)
        with record_paths() as paths:
            ours.step()
        assert paths[0] == "triton" and set(paths) <= {"triton", "foreach"}, paths
        ref.step()
        assert_params_close(ours_p, ref_p)


def test_table_refuses_a_grad_of_another_dtype_even_at_the_same_address():
    """torch's grad_dtype lets a grad differ from its param; the kernel reads every row in the param's dtype,
    so such a grad goes to the safe path, also when it took the address of last step's grad."""
    params = [torch.randn(64), torch.randn(32)]
    grads = [torch.randn(64), torch.randn(32)]
    table = tk.TensorTable()
    table.update([params, grads])
    assert table.fallback == []
    table.update([params, [grads[0], grads[1].view(torch.int32)]])  # same address, another dtype
    assert table.fallback == [1]
    table.update([params, [grads[0], torch.randn(16)]])  # another size
    assert table.fallback == [1]


def test_table_refuses_a_strided_grad_at_last_steps_address():
    params = [torch.randn(4, 4)]
    buffer = torch.randn(4, 4)
    table = tk.TensorTable()
    table.update([params, [buffer]])
    assert table.fallback == []
    table.update([params, [buffer.t()]])  # the same address, transposed
    assert table.fallback == [0]
