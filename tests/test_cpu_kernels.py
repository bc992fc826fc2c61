"""The fused level's CPU kernel for 16/8/4-bit state (``fastoptim.levels.cpu_kernels``).

The oracle is the rule's own ``update`` run on numpy float32 arrays of the stored values (IEEE arithmetic,
one rounding per operator, Python scalars rounded to fp32), whose results are then stored by the eager
codec (``storage``). The kernel must give exactly those bytes: params, bf16 states, codes and absmax.
(torch's own CPU ``sqrt`` is not correctly rounded in every lane, so the loop level is within an ulp of
this oracle, not equal to it; the staged-path tests in ``test_low_bit`` hold the levels to each other.)
"""

import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

import fastoptim
from fastoptim import levels, storage
from fastoptim.levels import cpu_kernels, record_paths
from fastoptim.registry import OPTIMIZERS

pytestmark = pytest.mark.skipif(cpu_kernels.available() is not None,
                                reason=f"no C++ toolchain: {cpu_kernels.available()}")

# rows that are, and are not, a multiple of the 8-bit (256) and 4-bit (128) blocks; odd row lengths (a
# 4-bit row ending in half a byte); a 3-D param; tails shorter than one AVX2 vector
SHAPES = [(3, 512), (48, 80), (16, 257), (5, 3, 31), (9, 131)]


class Twin(np.ndarray):
    """A float32 array with the methods ``rules.prims`` dispatches to."""

    def sqrt(self):
        return np.sqrt(self)

    def sign(self):
        return np.where(np.isnan(self), np.float32(0), np.sign(self))  # torch.sign: 0 for NaN

    def maximum(self, other):
        return np.maximum(self, other)

    def clamp(self, lo, hi):
        return np.minimum(np.maximum(self, lo), hi)


def _twin(t: torch.Tensor) -> Twin:
    return t.detach().float().numpy().copy().view(Twin)


def _stored(value, p):
    """What a state holds, as fp32 values (what every level loads)."""
    return storage.load(value, p.detach()) if not isinstance(value, torch.Tensor) else value.float()


def _oracle(opt, params, step, grad_mul=None):
    """Step ``step``'s params and states, computed from what is stored now, per param."""
    rule, group = opt.rule, opt.param_groups[0]
    host = rule.host_values(opt.state[params[0]], group)  # (NAdam's mu_product: the same for every param here)
    scalars = [np.float32(float(s)) for s in rule.scalars(group, step, *host)]
    out = []
    for p in params:
        entry = opt.state[p]
        g = _twin(p.grad)
        if grad_mul is not None:
            g = g * np.float32(grad_mul)
        states = [_twin(_stored(entry[n], p)) if n in entry else None for n in rule.state_names]
        new_p, *new_states = rule.update(_twin(p), g, *states, *scalars, *rule.flags(group))
        stored = {}
        for name, value in zip(rule.state_names, new_states):
            if value is None or name not in entry:
                continue
            as_tensor = torch.from_numpy(np.asarray(value, dtype=np.float32).copy())
            old = entry[name]
            if isinstance(old, storage.QuantizedState):
                stored[name] = storage.QuantizedState.of(as_tensor, old.fmt)
            else:
                stored[name] = as_tensor.to(old.dtype)
        out.append((torch.from_numpy(np.asarray(new_p, dtype=np.float32).copy()), stored))
    return out


def _assert_stored_equal(got, want, where):
    if isinstance(want, storage.QuantizedState):
        assert torch.equal(got.codes, want.codes), f"{where}: codes differ"
        assert torch.equal(got.absmax, want.absmax), f"{where}: absmax differs"
    else:
        assert got.dtype == want.dtype and torch.equal(got, want), f"{where}: differs"


CONFIGS = [(name, i) for name, spec in OPTIMIZERS.items() for i in range(len(spec.option_sets))]


@pytest.mark.parametrize("bits", (16, 8, 4))
@pytest.mark.parametrize("name,option", CONFIGS)
def test_the_kernel_gives_the_rules_ieee_math_on_the_stored_values_byte_for_byte(name, option, bits):
    spec = OPTIMIZERS[name]
    options = dict(spec.option_sets[option])
    g = torch.Generator().manual_seed(option)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]
    try:
        opt = spec.cls(params, impl="fused", state_bits=bits, min_quant_size=0, **options)
    except ValueError as e:  # centered RMSprop refuses 8/4 bits by name (tested in test_low_bit)
        assert bits in (8, 4) and "centered" in str(e)
        return
    for step in range(4):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        want = _oracle(opt, params, step + 1) if step else None  # from step 2 on: states hold real values
        with record_paths() as paths:
            opt.step()
        if not opt.state[params[0]].keys() - {"step"}:  # a rule that keeps no state here: nothing stored
            assert "cpu_kernel" not in paths
            return
        assert paths == ["cpu_kernel"], paths
        if want is None:
            continue
        for p, (new_p, states) in zip(params, want):
            assert torch.equal(p.detach(), new_p), f"step {step + 1}: param {tuple(p.shape)} differs"
            for state_name, value in states.items():
                _assert_stored_equal(opt.state[p][state_name], value, f"step {step + 1}: {state_name} of {tuple(p.shape)}")


@pytest.mark.parametrize("bits", (16, 8, 4))
def test_clipping_and_grad_scaling_multiply_the_grads_inside_the_kernel(bits):
    g = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]
    opt = fastoptim.AdamW(params, impl="fused", state_bits=bits, min_quant_size=0, max_grad_norm=0.5)
    for p in params:  # a first step makes the states
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()
    for step in range(1, 3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) * 3
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
        factor = (0.5 / (norm + 1e-6)).clamp(max=1.0)
        want = _oracle(opt, params, step + 1, grad_mul=float(factor))
        with record_paths() as paths:
            opt.step()
        assert paths == ["cpu_kernel"]
        assert float(factor) < 1.0  # the clip really scaled the grads
        assert torch.allclose(opt.last_grad_norm, norm)
        for p, (new_p, states) in zip(params, want):
            # the factor comes from fastoptim's own norm (a different summation order than the one above):
            # equal to a few ulp, so the params are compared closely rather than byte for byte
            torch.testing.assert_close(p.detach(), new_p, rtol=1e-6, atol=1e-7)


def test_params_the_kernel_does_not_take_run_staged_beside_it():
    """Plain-state params (1-D, small), a non-contiguous param and an fp64 one take the other paths."""
    g = torch.Generator().manual_seed(4)
    big = torch.nn.Parameter(torch.randn(64, 128, generator=g))
    small = torch.nn.Parameter(torch.randn(10, generator=g))
    strided = torch.nn.Parameter(torch.randn(128, 64, generator=g).t())
    params = [big, small, strided]
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = fastoptim.AdamW(params, impl="fused", state_bits=8, min_quant_size=0)
    ref = fastoptim.AdamW(twin, impl="loop", state_bits=8, min_quant_size=0)
    for _ in range(3):
        for a, b in zip(params, twin):
            a.grad = torch.randn(a.shape, generator=g)
            b.grad = a.grad.clone()
        with record_paths() as paths:
            opt.step()
        ref.step()
        assert "cpu_kernel" in paths and len(paths) > 1, paths
    for a, b in zip(params, twin):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)


def test_without_a_compiler_the_fused_level_warns_once_and_runs_staged(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no c++, g++ or clang++ to be found
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("FASTOPTIM_CACHE", str(tmp_path / "cache"))  # nothing built before
    _fresh_kernels()
    monkeypatch.setattr(levels.fused, "_kernel_warned", set())
    try:
        assert "no C++ compiler" in cpu_kernels.available()
        g = torch.Generator().manual_seed(5)
        params = [torch.nn.Parameter(torch.randn(16, 257, generator=g))]
        twin = [torch.nn.Parameter(params[0].detach().clone())]
        opt = fastoptim.Adam(params, impl="fused", state_bits=8, min_quant_size=0)
        ref = fastoptim.Adam(twin, impl="loop", state_bits=8, min_quant_size=0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                params[0].grad = torch.randn(16, 257, generator=g)
                twin[0].grad = params[0].grad.clone()
                with record_paths() as paths:
                    opt.step()
                ref.step()
                assert "cpu_kernel" not in paths
        said = [w for w in caught if "runs staged" in str(w.message)]
        assert len(said) == 1 and "no C++ compiler" in str(said[0].message)
        torch.testing.assert_close(params[0].detach(), twin[0].detach(), rtol=1e-5, atol=1e-6)
    finally:
        _fresh_kernels()


def _fresh_kernels():
    for cached in (cpu_kernels.available, cpu_kernels.kernel, cpu_kernels._library, cpu_kernels._target):
        cached.cache_clear()


def test_a_compiler_that_fails_is_reported_with_its_message(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", "false")
    monkeypatch.setenv("FASTOPTIM_CACHE", str(tmp_path))
    _fresh_kernels()
    try:
        why = cpu_kernels.available()
        assert why is not None and "false" in why
        assert list(tmp_path.glob("*.so")) == []  # nothing half-built is left to be loaded later
    finally:
        _fresh_kernels()


def test_an_unwritable_cache_folder_runs_staged_with_a_warning(monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("FASTOPTIM_CACHE", str(blocker / "cache"))  # under a file: cannot be made
    monkeypatch.setattr(levels.fused, "_kernel_warned", set())
    _fresh_kernels()
    try:
        p = torch.nn.Parameter(torch.randn(16, 256))
        p.grad = torch.randn_like(p)
        opt = fastoptim.AdamW([p], impl="fused", state_bits=8, min_quant_size=0)
        with pytest.warns(RuntimeWarning, match="not usable"), record_paths() as paths:
            opt.step()
        assert "cpu_kernel" not in paths
    finally:
        _fresh_kernels()


def test_a_damaged_cached_kernel_is_built_again(tmp_path):
    """In fresh processes (a loaded library must not be cut short under the process that runs it)."""
    env = dict(os.environ, FASTOPTIM_CACHE=str(tmp_path))
    probe = [sys.executable, "-c", "from fastoptim.levels import cpu_kernels; print(cpu_kernels.available())"]
    assert subprocess.run(probe, env=env, capture_output=True, text=True).stdout.strip() == "None"
    built = list(tmp_path.glob("kernel_*.so"))
    assert len(built) == 1
    built[0].write_bytes(b"")  # cut short (a full disk, a killed copy)
    done = subprocess.run(probe, env=env, capture_output=True, text=True)
    assert done.stdout.strip() == "None", done.stderr[-2000:]
    assert built[0].stat().st_size > 0


def test_a_kernel_that_fails_to_build_sends_only_its_params_staged(monkeypatch):
    def fail(*args, **kwargs):
        raise cpu_kernels.KernelUnavailable("this kernel failed to build")

    monkeypatch.setattr(levels.fused, "_kernel_warned", set())
    monkeypatch.setattr(cpu_kernels, "run", fail)
    p = torch.nn.Parameter(torch.randn(16, 256))
    twin = torch.nn.Parameter(p.detach().clone())
    opt = fastoptim.AdamW([p], impl="fused", state_bits=8, min_quant_size=0)
    ref = fastoptim.AdamW([twin], impl="loop", state_bits=8, min_quant_size=0)
    for _ in range(2):
        p.grad = torch.randn_like(p)
        twin.grad = p.grad.clone()
        with pytest.warns(RuntimeWarning, match="failed to build") if _ == 0 else warnings.catch_warnings():
            with record_paths() as paths:
                opt.step()
        ref.step()
        assert "cpu_kernel" not in paths
    torch.testing.assert_close(p.detach(), twin.detach(), rtol=1e-5, atol=1e-6)


def test_the_kernel_counts_its_in_place_write_for_autograd():
    w = torch.nn.Parameter(torch.randn(16, 256))
    opt = fastoptim.AdamW([w], impl="fused", state_bits=8, min_quant_size=0)
    x = torch.randn(4, 16, requires_grad=True)
    y = (x @ w).sin().sum()  # matmul saved w for x's grad: the step changes it under the graph
    w.grad = torch.randn_like(w)
    with record_paths() as paths:
        opt.step()
    assert paths == ["cpu_kernel"]
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_a_schedule_changing_lr_every_step_reuses_one_built_kernel():
    p = torch.nn.Parameter(torch.randn(32, 256))
    opt = fastoptim.AdamW([p], impl="fused", state_bits=8, min_quant_size=0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    assert cpu_kernels.available() is None  # (its own probe kernel is not counted below)
    cpu_kernels.kernel.cache_clear()
    for _ in range(4):
        p.grad = torch.randn_like(p)
        opt.step()
        sched.step()
    assert cpu_kernels.kernel.cache_info().misses == 1
