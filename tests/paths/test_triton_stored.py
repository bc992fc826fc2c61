"""The fused level's Triton kernel for 16/8/4-bit state (``fastoptim.paths.triton.stored``), proven without a
GPU: run by Triton's interpreter on CPU tensors, and compiled ahead of time for sm_80 and sm_90.

Two oracles, every step, every test asserting through ``record_paths`` that the kernel ran (not staged):
* the rule's own ``update`` on numpy float32 arrays of the stored values, stored by the eager codec
  (``test_cpu_kernels._oracle``): IEEE fp32 arithmetic, as the kernel computes it (``tl.div_rn``,
  ``tl.sqrt_rn``, no FMA) and as the interpreter evaluates it. Params, bf16 states, codes and absmax must be
  the same bytes. (bf16 is rounded to nearest even on the bits inside the kernel, not by a cast, so the
  interpreter, which truncates casts, and the GPU store the same bytes.)
* the loop level, run staged beside it from the same start: codes, absmax and bf16 states equal, params
  within the fp32 tolerance of the other level tests (atol 1e-6, rtol 1e-5). The params are not held equal:
  torch's CPU ``sqrt`` is not correctly rounded in every lane, so the loop level's params sit an ulp or two
  from the IEEE values (seen: up to 2.4e-7 on values of size ~1).
"""

import itertools
import re
from contextlib import contextmanager

import pytest
import torch

pytest.importorskip("triton")

import fastoptim  # noqa: E402
from fastoptim import storage  # noqa: E402
from fastoptim.engine import dispatch as levels  # noqa: E402
from fastoptim.paths.triton import TRITON_STORED  # noqa: E402
from fastoptim.storage import quant  # noqa: E402
from fastoptim.levels import record_paths  # noqa: E402
from fastoptim.paths.triton import stored as ts  # noqa: E402
from stored_state import FLIPPED_PARAM_ATOL  # noqa: E402
from conftest import ELEMENTWISE, ELEMENTWISE_CASES, STORED, pairwise_with, quantized, same_random_grads  # noqa: E402
from fastoptim.registry import OPTIMIZERS  # noqa: E402

# Kernel tests: the elementwise kernels run a rule's ``update``, which staged rules (Muon, Adafactor) do not have:
# they never run these kernels, and their stages are tested in tests/paths/test_stages.py. Hence ELEMENTWISE here.
from test_cpu_kernels import _assert_stored_equal, _oracle  # noqa: E402

# whole rows of every block size and aligned (the hinted branch); rows of 257, 93, 131 and 1000 elements
# (ragged: 1000 = 256 + 256 + 256 + 232; 131 and 93 odd, a 4-bit row ending in half a byte); a 3-D param.
# 8 rows of 257 are two tiles of one program at 16, 8 and 4 bits (the tile loop runs twice); more rows only
# add tiles for the interpreter to run (each ~60 ms), no branch.
SHAPES = [(3, 512), (8, 257), (5, 3, 31), (8, 131), (2, 1000)]
CONFIGS = ELEMENTWISE_CASES


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _params(seed, shapes=SHAPES):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes], g


def _clone(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def _stored_bytes(opt, params):
    """Every param and stored state, copied: what a skipped step must leave as it was."""
    out = []
    for p in params:
        out.append(p.detach().clone())
        for value in opt.state[p].values():
            if isinstance(value, storage.QuantizedState):
                out += [value.codes.clone(), value.absmax.clone()]
            elif isinstance(value, torch.Tensor):
                out.append(value.clone())
    return out


def _assert_same_stored(ours, base, ours_p, base_p, where, fp32_params=True):
    """Against the loop level run staged beside the kernel: params within the fp32 tolerance; stored states
    the same bytes but for values that land on the other side of a rounding boundary because the loop
    level's torch ops (its CPU ``sqrt``) rounded an ulp away: those may be one bf16 ulp or one code apart,
    in at most 1% of the elements. (Kahan's compensation is the rounding residue of the fp32 param, which an
    fp32 ulp changes by far more than a bf16 ulp of itself: the caller compares param plus compensation.)"""
    for i, (a, b) in enumerate(zip(ours_p, base_p)):
        if fp32_params:
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=lambda m: f"{where}, param {i}: {m}")
        for name, value in base.state[b].items():
            if name == storage.rounding.KAHAN:
                continue
            got, at = ours.state[a][name], f"{where}, param {i}, {name}"
            if isinstance(value, storage.QuantizedState):
                torch.testing.assert_close(got.absmax, value.absmax, atol=0, rtol=1e-5,
                                           msg=lambda m: f"{at} absmax: {m}")
                _assert_nearly_all_equal(_codes(got), _codes(value), f"{at} codes")
            elif isinstance(value, torch.Tensor) and value.dtype == torch.bfloat16:
                # bf16 bit patterns of values of one sign are ordered: the difference counts ulps
                _assert_nearly_all_equal(got.view(torch.int16).int(), value.view(torch.int16).int(), at)


def _codes(state):
    """One code per element (4-bit codes unpacked), as int32."""
    if state.fmt.bits == 4:
        return quant.unpack4(state.codes, quant.rows_of(state.shape)[1]).int()
    return state.codes.int()


def _assert_nearly_all_equal(got, want, where):
    assert got.shape == want.shape, where
    apart = (got - want).abs()
    if apart.numel():
        assert int(apart.max()) <= 1, f"{where}: {int(apart.max())} apart"
    assert int((apart != 0).sum()) <= max(1, apart.numel() // 100), f"{where}: {int((apart != 0).sum())} differ"


def _make(spec, params, impl, bits, options):
    try:
        return spec.cls(params, impl=impl, state_bits=bits, min_quant_size=0, **options)
    except ValueError as e:  # centered RMSprop refuses 8/4 bits by name (tested in test_low_bit)
        assert quantized(bits) and "centered" in str(e)
        return None


@pytest.mark.sample(("name", "option"), "bits")
@pytest.mark.parametrize("bits", STORED)
@pytest.mark.parametrize("name,option", CONFIGS)
def test_kernel_stores_the_ieee_oracles_bytes_and_matches_the_staged_loop_level(interpret, name, option, bits):
    spec = OPTIMIZERS[name]
    options = dict(spec.option_sets[option])
    ours_p, g = _params(option)
    base_p = _clone(ours_p)
    ours = _make(spec, ours_p, "fused", bits, options)
    base = _make(spec, base_p, "loop", bits, options)
    if ours is None:
        return
    for step in range(1, 4):
        same_random_grads(ours_p, base_p, g)
        want = _oracle(ours, ours_p, step) if step > 1 else None  # from step 2 on: states hold real values
        with record_paths() as paths:
            ours.step()
        base.step()
        if not ours.state[ours_p[0]].keys() - {"step"}:  # a rule keeping no state here: nothing stored
            assert "triton_stored" not in paths and paths == ["triton"], paths
            return
        assert paths == ["triton_stored"], paths  # one launch for the bucket, nothing staged
        if want is not None:
            for p, (new_p, states) in zip(ours_p, want):
                assert torch.equal(p.detach(), new_p), f"step {step}: param {tuple(p.shape)} differs from IEEE"
                for state_name, value in states.items():
                    _assert_stored_equal(ours.state[p][state_name], value, f"step {step}: {state_name} of "
                                         f"{tuple(p.shape)}")
        _assert_same_stored(ours, base, ours_p, base_p, f"step {step} vs loop")
    tables = next(c for c in ours._stepper.caches().values() if "triton_stored_tables" in c)["triton_stored_tables"]
    (table,) = tables.values()
    assert table.table[:, 3].tolist() == [1, 0, 0, 0, 0]  # the whole-rows branch for the aligned 512-rows only
    (formats, _), = tables.keys()
    assert int(table.table[1, 0]) > ts.tile_blocks(ts.codec_block(formats))  # 8 x 257: the tile loop ran twice


def test_which_params_the_kernel_takes_is_worked_out_again_only_when_a_grad_changes_kind(interpret, monkeypatch):
    """Per-param checks cost host time every step on a GPU: they run once per bucket, and again only when a
    grad's dtype or contiguity changes (a non-contiguous grad runs staged that step, and the numbers stay the
    loop level's)."""
    calls = []
    real = ts.signature
    monkeypatch.setattr(ts, "signature", lambda *a, **k: calls.append(a[3]) or real(*a, **k))
    ours_p, g = _params(0)
    base_p = _clone(ours_p)
    ours = _make(OPTIMIZERS["adamw"], ours_p, "fused", 8, {})
    base = _make(OPTIMIZERS["adamw"], base_p, "loop", 8, {})
    seen = []
    for step in range(1, 5):
        same_random_grads(ours_p, base_p, g)
        if step == 3:  # one grad of the same shape, transposed storage: not contiguous
            values = ours_p[0].grad.clone()
            ours_p[0].grad = values.t().contiguous().t()
            assert not ours_p[0].grad.is_contiguous()
        calls.clear()
        with record_paths() as paths:
            ours.step()
        base.step()
        seen.append((len(calls), paths))
        _assert_same_stored(ours, base, ours_p, base_p, f"step {step}")
    n = len(ours_p)
    assert seen[0] == (n, ["triton_stored"])  # worked out once: takes and run share it
    assert seen[1] == (0, ["triton_stored"])
    # a grad of another kind: worked out again for the bucket, and for the part the kernel takes (its own cache)
    assert seen[2][0] == n + (n - 1) and seen[2][1][0] == "triton_stored" and len(seen[2][1]) == 2  # (the rest:
    # the staged path's level)
    assert seen[3] == (n, ["triton_stored"])  # and back


@pytest.mark.parametrize("bits", (16, 8))
def test_a_state_re_laid_in_place_between_steps_is_seen(interpret, bits):
    """A state tensor made non-contiguous or re-typed in place (``.data = ...``) keeps the step plan (it is the
    same object): the kernel's split must see it, and the numbers stay the loop level's."""
    for change in ("transposed", "re-typed"):
        ours_p, g = _params(3, [(4, 256)])
        base_p = _clone(ours_p)
        ours = _make(OPTIMIZERS["adamw"], ours_p, "fused", bits, {})
        base = _make(OPTIMIZERS["adamw"], base_p, "loop", bits, {})
        for step in range(3):
            same_random_grads(ours_p, base_p, g)
            if step == 1:
                for opt, p in ((ours, ours_p[0]), (base, base_p[0])):
                    held = opt.state[p]["exp_avg"]
                    t = held if bits == 16 else held.codes
                    t.data = t.data.t().contiguous().t() if change == "transposed" else (
                        t.data.float() if bits == 16 else t.data.clone())
            ours.step()
            base.step()
            for a, b in zip(ours_p, base_p):
                torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=lambda m: f"{change}, step {step}: {m}")


def test_a_grad_of_another_size_is_refused_as_the_loop_level_refuses_it(interpret):
    """A grad re-shaped behind the param's back (``p.grad.data = ...``) after the kernel's split was worked out:
    the kernel must not read it as the param's shape (half its size: it read past its end)."""
    shape = (2, 256)
    params, g = _params(4, [(4, 256)])
    base_p = _clone(params)
    ours = _make(OPTIMIZERS["adamw"], params, "fused", 8, {})
    base = _make(OPTIMIZERS["adamw"], base_p, "loop", 8, {})
    same_random_grads(params, base_p, g)
    ours.step()
    base.step()
    for p in (params[0], base_p[0]):
        p.grad = torch.zeros_like(p)
        p.grad.data = torch.randn(shape, generator=g)
    with pytest.raises(RuntimeError) as loop_error:
        base.step()
    with pytest.raises(RuntimeError) as error:
        ours.step()
    assert type(error.value) is type(loop_error.value)


@pytest.mark.parametrize("bits", STORED)
def test_both_branches_ran_whole_aligned_rows_and_ragged_or_misaligned_ones(interpret, bits):
    """The table marks which branch each tensor takes; a param at an odd address (a view) takes the masked
    branch and is still stepped in the kernel, not refused."""
    storage_ = torch.randn(1 + 4 * 256)
    odd = torch.nn.Parameter(storage_[1:].view(4, 256))  # whole rows, but 4 bytes past a 16-byte boundary
    assert odd.data_ptr() % ts.ALIGN != 0
    params = [torch.nn.Parameter(torch.randn(4, 256)), torch.nn.Parameter(torch.randn(4, 250)), odd]
    base_p = _clone(params)
    ours = fastoptim.AdamW(params, impl="fused", state_bits=bits, min_quant_size=0)
    base = fastoptim.AdamW(base_p, impl="loop", state_bits=bits, min_quant_size=0)
    g = torch.Generator().manual_seed(7)
    for step in range(1, 3):
        same_random_grads(params, base_p, g)
        with record_paths() as paths:
            ours.step()
        base.step()
        assert paths == ["triton_stored"], paths
        _assert_same_stored(ours, base, params, base_p, f"step {step}")
    tables = next(c for c in ours._stepper.caches().values() if "triton_stored_tables" in c)["triton_stored_tables"]
    (table,) = tables.values()
    assert table.table[:, 3].tolist() == [1, 0, 0]  # whole: the aligned 256-row only


@pytest.mark.parametrize("bits", STORED)
def test_plain_state_params_run_staged_beside_the_kernel(interpret, bits):
    """A 1-D param keeps plain state at 8/4 bits (the plain Triton kernel steps it); a transposed one is not
    contiguous: it runs staged. The rest is in the stored kernel."""
    g = torch.Generator().manual_seed(4)
    params = [torch.nn.Parameter(torch.randn(8, 300, generator=g)), torch.nn.Parameter(torch.randn(10, generator=g)),
              torch.nn.Parameter(torch.randn(64, 8, generator=g).t())]
    base_p = _clone(params)
    ours = fastoptim.Adam(params, impl="fused", state_bits=bits, min_quant_size=0, weight_decay=0.1)
    base = fastoptim.Adam(base_p, impl="loop", state_bits=bits, min_quant_size=0, weight_decay=0.1)
    for step in range(1, 4):
        same_random_grads(params, base_p, g)
        with record_paths() as paths:
            ours.step()
        base.step()
        assert paths[0] == "triton_stored" and len(paths) > 1 and "triton_stored" not in paths[1:], paths
        _assert_same_stored(ours, base, params, base_p, f"step {step}")


@pytest.mark.sample("name", "bits")
@pytest.mark.parametrize("bits", STORED)
@pytest.mark.parametrize("name", ELEMENTWISE)
def test_grad_scaler_unscales_in_the_kernel_and_a_skipped_step_stores_nothing(interpret, monkeypatch, name, bits):
    """Under torch.amp.GradScaler the kernel multiplies the grads by 1/scale and reads found_inf itself: the
    poisoned step leaves params, codes, absmax and bf16 states byte for byte as they were, and the host never
    reads found_inf during a step."""
    spec = OPTIMIZERS[name]
    options = dict(spec.option_sets[1])
    ours_p, g = _params(11, [(6, 300), (4, 128)])
    base_p = _clone(ours_p)
    ours = _make(spec, ours_p, "fused", bits, options)
    base = _make(spec, base_p, "loop", bits, options)
    if ours is None:
        return
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1000) for _ in range(2)]
    reads = []
    real_item = torch.Tensor.item

    def item(t):
        if t is getattr(ours, "found_inf", None):
            reads.append(t)
        return real_item(t)

    for step in range(1, 5):
        grads = [torch.randn(p.shape, generator=g) for p in ours_p]
        if step == 2:
            grads[1][0, 0] = float("inf")
        for opt, params, scaler in ((ours, ours_p, scalers[0]), (base, base_p, scalers[1])):
            opt.zero_grad()
            scale = scaler.scale(torch.ones(()))  # (what scaling a loss does; it starts the scaler)
            for p, grad in zip(params, grads):
                p.grad = grad * scale
        before = _stored_bytes(ours, ours_p)
        monkeypatch.setattr(torch.Tensor, "item", item)
        try:
            with record_paths() as paths:
                scalers[0].step(ours)
        finally:
            monkeypatch.setattr(torch.Tensor, "item", real_item)
        scalers[1].step(base)
        for scaler in scalers:
            scaler.update()
        if step == 1 and not ours.state[ours_p[0]].keys() - {"step"}:
            pytest.skip(f"{name} keeps no state with options {options}")
        assert reads == []
        # step 1 makes the states (their first store), later steps launch the kernel; step 2 skips inside it
        assert paths == ["triton_stored"], paths
        if step == 2:
            after = _stored_bytes(ours, ours_p)
            assert all(torch.equal(a, b) for a, b in zip(before, after)), "a skipped step stored something"
        _assert_same_stored(ours, base, ours_p, base_p, f"step {step}")


@pytest.mark.parametrize("bits", STORED)
def test_clip_factor_multiplies_the_grads_in_the_kernel(interpret, bits):
    ours_p, g = _params(3, [(8, 256), (3, 200)])
    base_p = _clone(ours_p)
    ours = fastoptim.AdamW(ours_p, impl="fused", state_bits=bits, min_quant_size=0, max_grad_norm=0.5)
    base = fastoptim.AdamW(base_p, impl="loop", state_bits=bits, min_quant_size=0, max_grad_norm=0.5)
    for step in range(1, 4):
        same_random_grads(ours_p, base_p, g, scale=3)
        with record_paths() as paths:
            ours.step()
        base.step()
        assert paths == ["triton_stored"]
        assert float(ours.last_grad_norm) > 0.5  # the clip really scaled the grads
        _assert_same_stored(ours, base, ours_p, base_p, f"step {step}")


def test_thirty_tensors_of_three_shapes_in_one_launch(interpret):
    params, g = _params(5, [(2, 256), (3, 100), (1, 129)] * 10)
    base_p = _clone(params)
    ours = fastoptim.Lion(params, impl="fused", state_bits=4, min_quant_size=0, lr=1e-2)
    base = fastoptim.Lion(base_p, impl="loop", state_bits=4, min_quant_size=0, lr=1e-2)
    for step in range(1, 3):
        same_random_grads(params, base_p, g)
        with record_paths() as paths:
            ours.step()
        base.step()
        assert paths == ["triton_stored"]  # one launch
        _assert_same_stored(ours, base, params, base_p, f"step {step}")


def test_stored_level_is_declared_for_the_fused_level_under_triton(interpret):
    from fastoptim.engine import dispatch as levels

    cpu = torch.device("cpu")
    assert levels.stored_path("fused", cpu) is TRITON_STORED
    assert levels.stored_path("auto", cpu) is TRITON_STORED
    assert levels.stored_path("loop", cpu) is None and levels.stored_path("compiled", cpu) is None


def test_the_table_is_rebuilt_only_when_an_address_changes(interpret):
    """A new grad, or a state's codes moved to other memory in place (``share_memory_``), make a new table;
    the numbers stay the loop level's."""
    params, g = _params(6, [(4, 256)])
    base_p = _clone(params)
    opt = fastoptim.AdamW(params, impl="fused", state_bits=8, min_quant_size=0)
    base = fastoptim.AdamW(base_p, impl="loop", state_bits=8, min_quant_size=0)
    for step in range(4):
        grad = torch.randn(4, 256, generator=g) if step in (0, 2) else params[0].grad
        params[0].grad, base_p[0].grad = grad, grad.clone()
        if step == 3:
            opt.state[params[0]]["exp_avg"].codes.share_memory_()
        with record_paths() as paths:
            opt.step()
        base.step()
        assert paths == ["triton_stored"]
        _assert_same_stored(opt, base, params, base_p, f"step {step}")
        tables = next(c for c in opt._stepper.caches().values() if "triton_stored_tables" in c)["triton_stored_tables"]
        (table,) = tables.values()
        if step == 1:
            assert table.table is last  # same grad tensor, same addresses
        elif step:
            assert table.table is not last  # a new grad (step 2), a state moved in place (3): new addresses
        last = table.table


# --- ahead-of-time compile for real GPUs --------------------------------------------------------------

def _count(ptx: str, pattern: str) -> int:
    return len(re.findall(pattern, ptx))


def _formats(rule, group, bits):
    codec = storage.codecs.for_bits(bits)
    return tuple(None if not on else codec.format(signed=n not in rule.unsigned_states)
                 for n, on in zip(rule.state_names, rule.active(group)))


PER_THREAD = ts.TILE_ELEMENTS // (32 * ts.NUM_WARPS)  # elements each thread holds in one tile
# 128-bit accesses per thread and tile for each array kind, in the whole-rows branch
V4_FP32 = PER_THREAD * 4 // 16


# the defaults, but SGD's with momentum (its defaults keep no state); every elementwise rule is compiled
GROUPS = {"sgd": dict(momentum=0.9)}


@pytest.mark.sample("bits", "capability")
@pytest.mark.parametrize("name,bits,capability", pairwise_with(list(itertools.product(ELEMENTWISE, STORED)),
                                                                (90, 80)))
def test_kernel_compiles_for_gpu_with_vector_access_to_codes_and_values(name, bits, capability):
    """The whole-rows branch reads and writes p, g and each state with vector accesses (the masked branch
    has scalar ones): fp32 p and g in 128-bit vectors; 8-bit codes one 128-bit vector per thread (16
    codes), 4-bit codes one 64-bit vector (16 codes in 8 bytes), bf16 states 128-bit vectors. Arithmetic
    as the rule means it: IEEE division and root, no FMA; bf16 rounded on the bits, so no cvt to bf16."""
    rule = OPTIMIZERS[name].cls.rule
    group = {**rule.defaults, **GROUPS.get(name, {})}
    formats = _formats(rule, group, bits)
    n_states = sum(f is not None for f in formats)
    compiled = ts.compile_for_gpu(rule, group, formats, capability)
    ptx = compiled.asm["ptx"]
    assert f".target sm_{capability}" in ptx and len(compiled.asm["cubin"]) > 0
    v4_loads, v4_stores = _count(ptx, r"ld\.global(\.\w+)*\.v4\.b32"), _count(ptx, r"st\.global(\.\w+)*\.v4\.b32")
    v2_loads, v2_stores = _count(ptx, r"ld\.global(\.\w+)*\.v2\.b32"), _count(ptx, r"st\.global(\.\w+)*\.v2\.b32")
    if bits == 16:  # bf16: 16 elements are 32 bytes, two vectors
        assert (v4_loads, v4_stores) == (2 * V4_FP32 + 2 * n_states, V4_FP32 + 2 * n_states)
        assert (v2_loads, v2_stores) == (0, 0)
    elif bits in (8, "fp8_e4m3"):  # one byte an element
        assert (v4_loads, v4_stores) == (2 * V4_FP32 + n_states, V4_FP32 + n_states)
        assert (v2_loads, v2_stores) == (0, 0)
    else:
        assert (v4_loads, v4_stores) == (2 * V4_FP32, V4_FP32)
        assert (v2_loads, v2_stores) == (n_states, n_states)
    assert _count(ptx, r"\bdiv\.full\.") == 0 and _count(ptx, r"\bdiv\.approx\.") == 0
    assert _count(ptx, r"\brcp\.approx\.") == 0 and _count(ptx, r"\bsqrt\.approx\.") == 0
    assert _count(ptx, r"\bfma\.\w+\.f32\b") == 0
    assert _count(ptx, r"\bcvt(\.\w+)*\.bf16(x2)?\.f32\b") == 0
    codec = storage.codecs.for_bits(bits)
    if quantized(bits) and codec.triton_tables(0, formats[0] or codec.format()):
        # the dynamic maps: x / absmax, IEEE, per element of each quantized state, in both branches
        assert _count(ptx, r"\bdiv\.rn\.f32\b") >= 2 * PER_THREAD * n_states
    elif quantized(bits):  # the float formats: no table in memory (the divisions: the AdamW test below)
        assert ts._table_args(formats) == []


def test_adamw_8bit_global_accesses_per_element_group():
    """AdamW at 8 bits, whole-rows branch, per thread and tile of 16 elements: p 4 x v4 in and out, g 4 x v4
    in, each state's 16 codes one v4 in and out, each state's absmax one scalar in and out per block; two
    gathers per state and element from the map (1 KB) and the encoder's table (at most 23 KB), which stay
    in L1/L2 and are not HBM traffic. Bytes per param from HBM: 4 + 4 + 4 + 2 * (1 + 1) + 2 * 8 / 256."""
    rule = OPTIMIZERS["adamw"].cls.rule
    group = dict(rule.defaults)
    formats = _formats(rule, group, 8)
    ptx = ts.compile_for_gpu(rule, group, formats, 90).asm["ptx"]
    whole, ragged = _branches(ptx)
    assert _count(whole, r"ld\.global(\.\w+)*\.v4\.b32") == 2 * V4_FP32 + 2
    assert _count(whole, r"st\.global(\.\w+)*\.v4\.b32") == V4_FP32 + 2
    # scalar accesses in the whole branch: the gathers (map value and table entry, 2 states x 16 elements
    # each) and each state's absmax in and out
    assert _count(whole, SCALAR.format("ld", "b32")) == 2 * 2 * PER_THREAD + 2
    assert _count(whole, SCALAR.format("st", "b32")) == 2
    assert _count(whole, r"(ld|st)\.global(\.\w+)*\.b8") == 0
    assert _count(ragged, r"(ld|st)\.global(\.\w+)*\.v\d") == 0  # masked per element: scalar accesses
    assert _count(ragged, r"ld\.global(\.\w+)*\.b8") == 2 * PER_THREAD


SCALAR = r"\b{}\.global(?:\.(?!v\d)\w+)*\.{}\b"  # not a vector access


# AdamW's HBM bytes per param on paper, absmax aside: p 4 in + 4 out, g 4, two states in and out
PAPER_BYTES = {16: 4 + 4 + 4 + 2 * (2 + 2), 8: 4 + 4 + 4 + 2 * (1 + 1), 4: 4 + 4 + 4 + 2 * (0.5 + 0.5),
               "fp8_e4m3": 4 + 4 + 4 + 2 * (1 + 1)}


@pytest.mark.parametrize("bits", STORED)
def test_adamw_vector_bytes_per_element_agree_with_the_paper_count(bits):
    """The whole-rows branch's vector accesses, in bytes per element of a thread's 16, are the bytes per param
    written on paper: 20 (16-bit), 16 (8-bit), 14 (4-bit), plus absmax (8 B per 256 or 128 elements and state).
    On an H100 (3.35 TB/s) a step over 1e9 params moves 16.06 GB at 8 bits: 4.8 ms at full bandwidth."""
    rule = OPTIMIZERS["adamw"].cls.rule
    group = dict(rule.defaults)
    whole, _ = _branches(ts.compile_for_gpu(rule, group, _formats(rule, group, bits), 90).asm["ptx"])
    vector_bytes = sum(width * _count(whole, rf"(ld|st)\.global(\.\w+)*\.v{n}\.b32") for n, width in ((4, 16), (2, 8)))
    assert vector_bytes / PER_THREAD == PAPER_BYTES[bits]
    if quantized(bits) and not storage.codecs.for_bits(bits).triton_tables(0, storage.codecs.for_bits(bits).format()):
        # a float format: its codes go through integer operations and one division a block (the scale), so the
        # kernel has no more IEEE divisions per element than the same rule at 16 bits (the rule's own)
        plain, _ = _branches(ts.compile_for_gpu(rule, group, _formats(rule, group, 16), 90).asm["ptx"])
        extra = _count(whole, r"\bdiv\.rn\.f32\b") - _count(plain, r"\bdiv\.rn\.f32\b")
        assert 0 < extra < PER_THREAD, extra


def _branches(ptx: str) -> tuple[str, str]:
    """The PTX of the whole-rows branch and of the masked one: told apart by the ragged branch's 64-bit
    division (block // blocks per row), which the whole branch never does."""
    lines = ptx.splitlines()
    first_div = next(i for i, line in enumerate(lines) if re.search(r"\bdiv\.s64\b", line))
    vectors = [i for i, line in enumerate(lines) if re.search(r"\.global(\.\w+)*\.v4\.", line)]
    assert vectors and max(vectors) < first_div, "the hinted branch does not come first"
    return "\n".join(lines[:first_div]), "\n".join(lines[first_div:])


# --- bf16 params rounded stochastically in the kernel ------------------------------------------------------

@contextmanager
def _staged():
    """The fused level with no stored-state path declared: every non-plain bucket runs staged (the plain
    Triton kernel on fp32 temporaries, the same IEEE arithmetic as the stored kernel, then torch's codec and
    ``storage.rounding.stochastic_round``)."""
    real = levels.stored_path
    levels.stored_path = lambda *args, **kwargs: None
    try:
        yield
    finally:
        levels.stored_path = real


@pytest.mark.sample(("name", "rounding"), ("bits", "rounding"))
@pytest.mark.parametrize("rounding", ("stochastic", "kahan"))
@pytest.mark.parametrize("bits", (32, *STORED))
@pytest.mark.parametrize("name", ELEMENTWISE)
def test_bf16_params_rounded_in_the_kernel_as_the_staged_path_rounds_them(interpret, name, bits, rounding):
    """bf16 params with rounding="stochastic": the kernel adds the bits ``storage.rounding.stochastic_round`` draws
    (mix32 of each element's index plus the step's key) on the fp32 pattern; with "kahan" it steps the param
    plus its compensation and stores the param rounded to nearest and what that lost. Against the staged
    path of the same level (the same IEEE fp32 math, then torch's rounding and codec): every param, state,
    compensation and random stream the same bytes. Against the staged loop level: params one bf16 ulp apart
    in at most 1% of the elements (an fp32 value an ulp away, from torch's CPU sqrt, can cross a rounding
    threshold). A 1-D param keeps plain (bf16) state at 8/4 bits: a second launch, of its own formats."""
    spec = OPTIMIZERS[name]
    options = dict(spec.option_sets[1])
    if quantized(bits) and spec.cls.rule.refuses_quantized_state({**spec.cls.rule.defaults, **options}):
        options = dict(spec.option_sets[0])
    g = torch.Generator().manual_seed(8)
    ours_p = [torch.nn.Parameter(torch.randn(s, generator=g).bfloat16()) for s in [(3, 512), (9, 131), (40,)]]
    staged_p, loop_p = _clone(ours_p), _clone(ours_p)
    low = dict(state_bits=bits, min_quant_size=0, rounding=rounding)
    ours = spec.cls(ours_p, impl="fused", **low, **options)
    staged = spec.cls(staged_p, impl="fused", **low, **options)
    loop = spec.cls(loop_p, impl="loop", **low, **options)
    flipped = False  # a stored code one apart from the loop level's (see _assert_same_stored) moves later params
    start = _clone(loop_p)
    for step in range(1, 4):
        for a, b, c in zip(ours_p, staged_p, loop_p):
            a.grad = torch.randn(a.shape, generator=g).bfloat16()
            b.grad, c.grad = a.grad.clone(), a.grad.clone()
        with record_paths() as paths:
            ours.step()
        with _staged(), record_paths() as staged_paths:
            staged.step()
        loop.step()
        assert paths and set(paths) == {"triton_stored"}, paths
        assert "triton_stored" not in staged_paths, staged_paths
        for i, (a, b, c) in enumerate(zip(ours_p, staged_p, loop_p)):
            where = f"step {step}, param {i}"
            assert a.dtype == torch.bfloat16 and torch.equal(a, b), where
            if rounding == "stochastic":
                assert ours.state[a][storage.rounding.RNG].tolist() == [storage.rounding.rounding_seed(i), step]
                assert torch.equal(ours.state[a][storage.rounding.RNG], loop.state[c][storage.rounding.RNG])
            else:
                if not torch.equal(c, start[i]):  # (ADOPT's first step moves no param)
                    assert ours.state[a][storage.rounding.KAHAN].abs().max() > 0  # the compensation is kept
                compensated = a.float() + ours.state[a][storage.rounding.KAHAN].float()
                # (the compensation is bf16: an fp32 ulp between the two new params, from torch's CPU sqrt, can
                # move it by a bf16 ulp of itself, up to 2**-16 of the param)
                torch.testing.assert_close(compensated, c.float() + loop.state[c][storage.rounding.KAHAN].float(),
                                           atol=FLIPPED_PARAM_ATOL if flipped else 1e-6, rtol=2 ** -16)
            for state_name, value in staged.state[b].items():
                if isinstance(value, (torch.Tensor, storage.QuantizedState)):
                    _assert_stored_equal(ours.state[a][state_name], value, f"{where}, {state_name}")
                else:
                    assert ours.state[a][state_name] == value, f"{where}, {state_name}"
            _assert_nearly_all_equal(a.view(torch.int16).int(), c.view(torch.int16).int(), where)
        _assert_same_stored(ours, loop, ours_p, loop_p, f"step {step}", fp32_params=False)
        flipped = flipped or any(not torch.equal(_codes(x), _codes(loop.state[c][n]))
                                 for a, c in zip(ours_p, loop_p) for n, x in ours.state[a].items()
                                 if isinstance(x, storage.QuantizedState))


@pytest.mark.parametrize("rounding", ("stochastic", "kahan"))
def test_bf16_rounding_skips_a_grad_scaler_step_storing_nothing(interpret, rounding):
    """A skipped step stores nothing: no param, state or compensation, and no draw counted. Kahan rounding
    reads found_inf in the kernel (launched, skipped inside); stochastic rounding reads it first on the host,
    because the draw counter lives there."""
    ours_p = [torch.nn.Parameter(torch.randn(4, 256).bfloat16())]
    opt = fastoptim.AdamW(ours_p, impl="fused", state_bits=8, min_quant_size=0, rounding=rounding)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    for step in range(1, 4):
        scale = scaler.scale(torch.ones(()))
        ours_p[0].grad = (torch.randn(4, 256) * scale).bfloat16()
        if step == 2:
            ours_p[0].grad[0, 0] = float("inf")
        before = _stored_bytes(opt, ours_p)
        with record_paths() as paths:
            scaler.step(opt)
        scaler.update()
        skipped_on_host = step == 2 and rounding == "stochastic"
        assert paths == ([] if skipped_on_host else ["triton_stored"]), paths
        if step == 2:
            assert all(torch.equal(a, b) for a, b in zip(before, _stored_bytes(opt, ours_p)))
    if rounding == "stochastic":
        assert opt.state[ours_p[0]][storage.rounding.RNG].tolist()[1] == 2  # three steps, one skipped


@pytest.mark.sample("capability")
@pytest.mark.parametrize("capability", [80, 90])
@pytest.mark.parametrize("bits", STORED)
def test_stochastic_rounding_kernel_compiles_with_vector_access_and_no_float_rounding(bits, capability):
    """bf16 params and grads: two 128-bit vectors per thread and tile each (16 elements); the rounding is
    integer arithmetic on the bits: no conversion to bf16 anywhere."""
    rule = OPTIMIZERS["adamw"].cls.rule
    group = dict(rule.defaults)
    formats = _formats(rule, group, bits)
    ptx = ts.compile_for_gpu(rule, group, formats, capability, rounding="stochastic").asm["ptx"]
    state_v4 = {16: 2 * 2, 8: 2, 4: 0, "fp8_e4m3": 2}[bits]
    assert _count(ptx, r"ld\.global(\.\w+)*\.v4\.b32") == 2 + 2 + state_v4
    assert _count(ptx, r"st\.global(\.\w+)*\.v4\.b32") == 2 + state_v4
    assert _count(ptx, r"\bcvt(\.\w+)*\.bf16(x2)?\.f32\b") == 0
    assert _count(ptx, r"\bmul\.lo\.s32\b|\bmul\.lo\.u32\b") > 0  # the hash's multiplies
    # the hash shifts its 32-bit values logically (an arithmetic shift would draw other bits than torch's
    # int64 arithmetic): it adds no arithmetic shift to the kernel rounded to nearest
    nearest = ts.compile_for_gpu(rule, group, formats, capability).asm["ptx"]
    assert _count(ptx, r"\bshr\.s32\b") == _count(nearest, r"\bshr\.s32\b")
    assert _count(ptx, r"\bshr\.u32\b") > _count(nearest, r"\bshr\.u32\b")


@pytest.mark.sample("name", "bits")
@pytest.mark.parametrize("bits", STORED)
@pytest.mark.parametrize("name", ELEMENTWISE)
def test_tensor_hyperparameters_are_read_from_memory_by_the_kernel(interpret, name, bits):
    """Hyper-parameters held as 0-d tensors and written in place each step (a device-side schedule): the
    kernel reads them from memory and stores what it stores with Python floats."""
    from runs import TENSOR_HYPER, as_tensors

    spec = OPTIMIZERS[name]
    options = dict(spec.option_sets[1])
    if name in ("sgd", "rmsprop"):
        options["momentum"] = 0.9
    runs = []
    for as_tensor in (False, True):
        params, g = _params(9, [(4, 256), (3, 100)])
        opt = spec.cls(params, impl="fused", state_bits=bits, min_quant_size=0, **options)
        if as_tensor:
            as_tensors(opt.param_groups[0], TENSOR_HYPER[name])
        for step in range(1, 4):
            lr = options["lr"] * (1 + 0.1 * step)
            if as_tensor:
                opt.param_groups[0]["lr"].fill_(lr)
            else:
                opt.param_groups[0]["lr"] = lr
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            with record_paths() as paths:
                opt.step()
            assert paths == ["triton_stored"], paths
        runs.append((opt, params))
    (floats, float_p), (tensors, tensor_p) = runs
    # scalars derived from tensors are computed in fp32 (from floats: in fp64, then rounded): an ulp apart
    _assert_same_stored(tensors, floats, tensor_p, float_p, "tensors vs floats")


@pytest.mark.parametrize("bits", STORED)
def test_nan_and_inf_grads_store_what_the_staged_path_stores(interpret, bits):
    """A NaN and an inf in the grads (no GradScaler to skip them): params, states and absmax come out as the
    staged path of the same level stores them, NaN where it has NaN. (Which NaN is not compared: torch's CPU
    conversion makes every NaN 0xFFFF in bf16, CUDA's 0x7FFF, the kernel 0x7FC0; and a block holding a NaN has
    a NaN absmax, so its codes mean nothing: they are compared through the values they decode to.)"""
    ours_p, g = _params(10, [(2, 300), (3, 256)])
    staged_p = _clone(ours_p)
    ours = fastoptim.Adam(ours_p, impl="fused", state_bits=bits, min_quant_size=0)
    staged = fastoptim.Adam(staged_p, impl="fused", state_bits=bits, min_quant_size=0)
    same = dict(atol=0, rtol=0, equal_nan=True)
    for step in range(1, 3):
        for a, b in zip(ours_p, staged_p):
            a.grad = torch.randn(a.shape, generator=g)
            if step == 2:
                a.grad[0, 3], a.grad[1, 280 % a.shape[1]] = float("nan"), float("inf")
            b.grad = a.grad.clone()
        with record_paths() as paths:
            ours.step()
        with _staged():
            staged.step()
        assert paths == ["triton_stored"]
        for a, b in zip(ours_p, staged_p):
            torch.testing.assert_close(a, b, **same)
            for name in ("exp_avg", "exp_avg_sq"):
                x, y = ours.state[a][name], staged.state[b][name]
                if isinstance(y, storage.QuantizedState):
                    torch.testing.assert_close(x.absmax, y.absmax, **same)
                    torch.testing.assert_close(x.dequantize(), y.dequantize(), **same)
                    finite = torch.isfinite(y.absmax).repeat_interleave(y.fmt.block, dim=1)
                    codes_x, codes_y = _codes(x), _codes(y)
                    finite = finite[:, :codes_y.shape[1]]
                    assert torch.equal(codes_x[finite], codes_y[finite]), name
                else:
                    torch.testing.assert_close(x, y, **same)
    assert ours_p[0].isnan().any()  # the NaN really went through


@pytest.mark.sample("capability")
@pytest.mark.parametrize("capability", [80, 90])
@pytest.mark.parametrize("bits", STORED)
def test_kahan_rounding_kernel_compiles_with_vector_access_and_no_float_rounding(bits, capability):
    """bf16 params, grads and compensations: two 128-bit vectors per thread and tile each (the compensation
    read and written like the param); rounding to nearest on the bits: no conversion to bf16 anywhere."""
    rule = OPTIMIZERS["adamw"].cls.rule
    group = dict(rule.defaults)
    formats = _formats(rule, group, bits)
    ptx = ts.compile_for_gpu(rule, group, formats, capability, rounding="kahan").asm["ptx"]
    state_v4 = {16: 2 * 2, 8: 2, 4: 0, "fp8_e4m3": 2}[bits]
    assert _count(ptx, r"ld\.global(\.\w+)*\.v4\.b32") == 2 + 2 + 2 + state_v4
    assert _count(ptx, r"st\.global(\.\w+)*\.v4\.b32") == 2 + 2 + state_v4
    assert _count(ptx, r"\bcvt(\.\w+)*\.bf16(x2)?\.f32\b") == 0
    assert _count(ptx, r"\bfma\.\w+\.f32\b") == 0


@pytest.mark.parametrize("bits", STORED)
def test_tensors_spanning_several_programs_split_mid_row(interpret, bits):
    """A program takes ``CHUNK_TILES`` tiles of a tensor: rows of 600 (ragged at 8 and 4 bits) put a program
    boundary inside a row; 40 x 512 is whole rows over two programs too."""
    params, g = _params(12, [(30, 600), (40, 512)])
    base_p = _clone(params)
    ours = fastoptim.AdamW(params, impl="fused", state_bits=bits, min_quant_size=0)
    base = fastoptim.AdamW(base_p, impl="loop", state_bits=bits, min_quant_size=0)
    for step in range(1, 3):
        same_random_grads(params, base_p, g)
        with record_paths() as paths:
            ours.step()
        base.step()
        assert paths == ["triton_stored"]
        _assert_same_stored(ours, base, params, base_p, f"step {step}")
    tables = next(c for c in ours._stepper.caches().values() if "triton_stored_tables" in c)["triton_stored_tables"]
    (table,) = tables.values()
    starts = [int(b) for t, b in table.work.tolist() if t == 0]
    assert len(starts) > 1 and any(b % int(table.table[0, 2]) for b in starts)  # a program starts mid-row
    length = 30 * 600 if bits == 16 else 600  # 16-bit state: the flat tensor is the one row
    assert table.table[:, 3].tolist() == [int(length % ts.block_of(bits) == 0), 1]


@pytest.mark.parametrize("bits", [key for key in STORED if quantized(key)])
def test_the_kernels_store_gives_the_codecs_codes_on_hard_values(interpret, bits):
    """The kernel's encoder on the values whose codes are easy to get wrong (every rounding boundary and its fp32
    neighbours, subnormal and tiny values, a tiny block absmax, quotients that underflow: ``test_cpu_kernels``'s
    blocks), against the codec's own span encode. Signed: SGD's first momentum buffer is the grad itself;
    unsigned: RMSprop with alpha=0 stores grad * grad."""
    from test_cpu_kernels import _blocks, _hard_values

    codec = storage.codecs.for_bits(bits)
    g = torch.Generator().manual_seed(9)
    for signed in (True, False):
        fmt = codec.format(signed)
        # (-0.0 aside: the rule's first momentum is 0.9 * 0 + g, +0.0 where g is -0.0; and blocks with a NaN or an
        # inf, whose scale is NaN or inf: the dynamic maps' codes there follow which NaN a quotient gives, numpy's
        # here, the GPU's there; fp8's take x's sign, and test_nan_and_inf_grads_store_what_the_staged_path_stores
        # covers them)
        blocks = [torch.where(b == 0, 0.0, b.float()) for b in _blocks(_hard_values(fmt, g), fmt.block, g)
                  if b.isfinite().all()]
        grads = blocks if signed else [b.abs().sqrt() for b in blocks]
        params = [torch.nn.Parameter(torch.zeros(1, b.numel())) for b in grads]
        for p, grad in zip(params, grads):
            p.grad = grad.reshape(1, -1).clone()
        opt = (fastoptim.SGD(params, lr=0.0, momentum=0.9, impl="fused", state_bits=bits, min_quant_size=0)
               if signed else fastoptim.RMSprop(params, lr=0.0, alpha=0.0, impl="fused", state_bits=bits,
                                                min_quant_size=0))
        with record_paths() as paths:
            opt.step()
        assert set(paths) == {"triton_stored"}, paths
        name = "momentum_buffer" if signed else "square_avg"
        for p, grad in zip(params, grads):
            state = opt.state[p][name]
            assert state.fmt == fmt
            values = grad.reshape(1, -1) if signed else grad.reshape(1, -1) * grad.reshape(1, -1)
            want_codes, want_absmax = codec.encode_span(values, fmt)
            if fmt.bits == 4:
                want_codes = quant.pack4(want_codes)
            torch.testing.assert_close(state.absmax, want_absmax, rtol=0, atol=0, equal_nan=True)
            assert torch.equal(state.codes.reshape(want_codes.shape), want_codes), (fmt.tag, grad.numel())
