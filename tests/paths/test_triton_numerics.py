"""What the Triton kernel computes, number for number, under Triton's interpreter on CPU tensors.

* Every dtype torch.optim takes steps at the fused level (and "auto") by the path the docs state:
  fp32, bf16, fp16 and complex64 (its fp32 real view) in the kernel; fp64 and complex128 on the foreach
  level. ``record_paths`` says which ran.
* 16-bit storage: one kernel step against the loop level's fp32 math on the same 16-bit inputs.
"""

import pytest
import torch

pytest.importorskip("triton")

from conftest import ELEMENTWISE, ELEMENTWISE_CASES, assert_state_close  # noqa: E402
from fastoptim.levels import record_paths  # noqa: E402
from fastoptim.paths.triton import kernels as tk  # noqa: E402
from fastoptim.registry import OPTIMIZERS  # noqa: E402

# Kernel tests: the elementwise kernels run a rule's ``update``, which staged rules (Muon, Adafactor) do not have:
# they never run these kernels, and their stages are tested in tests/paths/test_stages.py. Hence ELEMENTWISE here.

# contiguous and aligned: every param goes into the kernel (no strided fallback beside it); one spans two
# unmasked blocks and ends mid-block
SHAPES = [(2 * tk.BLOCK + 37,), (5, 7), (1,)]


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _params(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    real = dtype.to_real() if dtype.is_complex else dtype
    out = []
    for shape in SHAPES:
        x = torch.randn(shape + ((2,) if dtype.is_complex else ()), generator=g, dtype=torch.float64)
        x = x * torch.logspace(-3, 2, x.numel(), dtype=torch.float64).reshape(x.shape)  # many binades
        x = x.to(real)
        out.append(torch.nn.Parameter(torch.view_as_complex(x) if dtype.is_complex else x))
    return out


def _set_grads(step, param_sets):
    g = torch.Generator().manual_seed(1000 + step)
    for i, ref in enumerate(param_sets[0]):
        grad = torch.randn(ref.shape, generator=g, dtype=ref.dtype)
        for params in param_sets:
            params[i].grad = grad.clone()


def _run_pair(name, index, dtype, impl, steps=4):
    """The loop level and ``impl`` on the same params and grads; yields after each step with the paths
    ``impl`` took."""
    spec = OPTIMIZERS[name]
    opts = spec.option_sets[index]
    base_p = _params(dtype)
    ours_p = [torch.nn.Parameter(p.detach().clone()) for p in base_p]
    base = spec.cls(base_p, impl="loop", **opts)
    ours = spec.cls(ours_p, impl=impl, **opts)
    for step in range(1, steps + 1):
        _set_grads(step, [base_p, ours_p])
        base.step()
        with record_paths() as paths:
            ours.step()
        yield step, base, ours, base_p, ours_p, paths


@pytest.mark.sample(("name", "index"), ("dtype", "impl"))
@pytest.mark.parametrize("impl", ["fused", "auto"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128], ids=["fp64", "complex128"])
@pytest.mark.parametrize("name,index", ELEMENTWISE_CASES)
def test_fp64_steps_on_the_foreach_level(interpret, name, index, dtype, impl):
    """The kernel takes no fp64 (Triton passes Python floats as fp32 and ``div_rn``/``sqrt_rn`` are fp32
    only): fp64 buckets, complex128's real view among them, step on the foreach level, exact in fp64, and
    say so in ``record_paths``."""
    for step, base, ours, base_p, ours_p, paths in _run_pair(name, index, dtype, impl):
        assert paths == ["foreach"], paths
        for i, (a, b) in enumerate(zip(ours_p, base_p)):
            assert a.dtype == dtype
            torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12, msg=lambda m: f"step {step}, param {i}: {m}")
            for k, v in base.state[b].items():
                if isinstance(v, torch.Tensor) and v.is_floating_point():
                    assert_state_close(ours.state[a][k], v, msg=f"step {step}, param {i}, {k}", atol=1e-12,
                                       rtol=1e-12)


@pytest.mark.sample(("name", "dtype"), ("dtype", "impl"))
@pytest.mark.parametrize("impl", ["fused", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64], ids=["fp32", "complex64"])
@pytest.mark.parametrize("name", ELEMENTWISE)
def test_fp32_and_complex64_step_in_the_kernel(interpret, name, dtype, impl):
    for step, base, ours, base_p, ours_p, paths in _run_pair(name, 1, dtype, impl):
        assert paths == ["triton"], paths
        for i, (a, b) in enumerate(zip(ours_p, base_p)):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=lambda m: f"step {step}, param {i}: {m}")


# --- 16-bit storage ----------------------------------------------------------------------------------

def _ordered(x: torch.Tensor) -> torch.Tensor:
    """A 16-bit float's bits as an integer that counts representable values: neighbours differ by 1, +0 and
    -0 are the same, so ``|_ordered(a) - _ordered(b)|`` is the distance in ulps (across binades too)."""
    bits = x.view(torch.int16).to(torch.int32)
    return torch.where(bits < 0, -(bits & 0x7FFF), bits)


def _truncate(x32: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 -> bf16 by dropping the low 16 bits (toward zero), as Triton's interpreter casts."""
    assert dtype == torch.bfloat16
    return (x32.view(torch.int32) & ~0xFFFF).view(torch.float32).to(dtype)  # exact: already a bf16 value


def _compare(ours: torch.Tensor, exact32: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    nearest = exact32.to(dtype)  # torch's cast rounds to nearest even: what the GPU's cvt.rn stores
    nan = nearest.isnan()
    assert torch.equal(ours.isnan(), nan), f"{what}: NaN in different places"
    ours, nearest, exact32 = ours[~nan], nearest[~nan], exact32[~nan]
    ulps = (_ordered(ours) - _ordered(nearest)).abs()
    assert ulps.numel() == 0 or ulps.max().item() <= 1, f"{what}: {ulps.max().item()} ulps from round-to-nearest"
    if dtype == torch.bfloat16:
        # truncation never moves away from zero: |ours| <= |nearest| wherever they differ
        assert (ours.float().abs() <= nearest.float().abs()).all(), f"{what}: rounded away from zero"
        # and it is the truncation of the fp32 result wherever that result is the same fp32 number
        agree = (_truncate(exact32, dtype) == ours).float().mean().item() if ours.numel() else 1.0
        assert agree >= 0.95, f"{what}: only {agree:.3f} of the values are the truncated fp32 result"
    else:
        same = (ours == nearest).float().mean().item() if ours.numel() else 1.0
        assert same >= 0.95, f"{what}: only {same:.3f} of the values are the nearest fp16"


@pytest.mark.sample(("name", "dtype"))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name,index", ELEMENTWISE_CASES)
def test_16bit_kernel_step_is_the_loop_level_rounded_once(interpret, name, index, dtype):
    """bf16/fp16 params and states: each step, the interpreted kernel against the loop level's fp32 math on
    the very same 16-bit inputs, rounded once to the 16-bit type.

    The oracle is the loop level on fp32 copies (not the loop level on 16-bit tensors, which rounds after
    every operator and is many ulps from a single rounding): the kernel widens its 16-bit loads exactly,
    computes in fp32 and rounds once when it stores. Each step starts both from the kernel's own 16-bit
    state, so differences do not compound and the bound is per step.

    Facts measured on triton 3.9's interpreter (a probe casting 65536 fp32 values over 12 decades, plus
    hand-made ties), the reason for the tolerance:
    * fp32 -> bf16 truncates toward zero: every value equalled its low 16 bits cleared, even with
      ``fp_downcast_rounding="rtne"`` on the cast (1 + 3 * 2**-8 stored 1.0078125; round-to-nearest-even
      gives 1.015625). The GPU's ``cvt.rn.bf16x2.f32`` rounds to nearest even (the PTX test checks it), so
      the interpreter's bf16 stores sit up to 1 bf16 ulp (at the value's magnitude) toward zero from what
      the GPU stores: tolerance 1 ulp, never away from zero.
    * fp32 -> fp16 rounds to nearest even (numpy's cast), equal to torch's cast on all 65536 values and on
      the ties: it matches the GPU's ``cvt.rn.f16x2.f32``.
    * fp32 arithmetic: the interpreter's division and square root are IEEE (numpy), as ``div.rn.f32`` and
      ``sqrt.rn.f32`` are on the GPU; torch's CPU sqrt is not always (on this machine it was 1 ulp off the
      correctly rounded root for ~17% of 16K vectorised elements). So the oracle's fp32 value can be an fp32
      ulp or so off, which moves its 16-bit rounding only when it sits on a rounding boundary. Over every
      case and step 142 of 540855 bf16 values were not the truncated oracle, all in RMSprop's first step
      (momentum buffer g / sqrt(0.01 g^2) = +-10 exactly in IEEE arithmetic, 9.999999 through torch's
      sqrt, 1 bf16 ulp apart once truncated: 2.2% of that step), and 2 of 540855 fp16 values were not the
      nearest fp16 of the oracle. Hence: every value within 1 ulp; at least 95% exactly the interpreter's
      rounding of the oracle.
    """
    spec = OPTIMIZERS[name]
    rule = spec.cls.rule
    opts = spec.option_sets[index]
    ours_p = _params(dtype)
    base_p = [torch.nn.Parameter(p.detach().float()) for p in ours_p]
    ours = spec.cls(ours_p, impl="fused", **opts)
    base = spec.cls(base_p, impl="loop", **opts)
    group = ours.param_groups[0]
    starts = {n: rule.initial_value(n, group) for n, on in zip(rule.state_names, rule.active(group)) if on}
    if not rule.eager_state and any(starts.values()):  # (Rprop's step sizes start at lr: at its 16-bit rounding here)
        for b in base_p:
            base.state[b] = {"step": 0, **{n: torch.full_like(b, v).to(dtype).float() for n, v in starts.items()}}
    for step in range(1, 6):
        _set_grads(step, [ours_p])
        for a, b in zip(ours_p, base_p):  # same 16-bit inputs, widened exactly
            b.data.copy_(a.detach().float())
            b.grad = a.grad.float()
            for k, v in ours.state[a].items():
                if isinstance(v, torch.Tensor) and v.is_floating_point() and k != "step":
                    base.state[b][k].copy_(v.float())
        with record_paths() as paths:
            ours.step()
        assert paths == ["triton"], paths
        base.step()
        got, want = [], []
        for a, b in zip(ours_p, base_p):
            got.append(a.detach().flatten())
            want.append(b.detach().flatten())
            for k in rule.state_names:
                if k in base.state[b]:
                    got.append(ours.state[a][k].flatten())
                    want.append(base.state[b][k].flatten())
        assert all(t.dtype == dtype for t in got)
        _compare(torch.cat(got), torch.cat(want), dtype, f"step {step}")
