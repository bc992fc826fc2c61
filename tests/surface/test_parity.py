"""Every optimizer x option set x level matches torch.optim (single-tensor) after each of 20 steps, on every
device there is (conftest.DEVICES: the CPU, plus CUDA where available).

The oracles' runs are shared: torch.optim's run of one (optimizer, option set, device) and the loop level's are
computed once per test process (``_reference_run``, ``_loop_run``) and every level's test compares with the same
numbers. They are deterministic (the grads come from seeded generators), so each level is checked against exactly
what it was checked against when each test ran its own oracle; only the repeated oracle runs are gone."""

from functools import lru_cache

import pytest
import torch

from conftest import (CASES, DEVICES, ELEMENTWISE, FLAT, MATRIX, assert_params_close, assert_state_close, clone_params,
                      make_params, param_atol, set_grads, shape_for, state_rtol, two_groups)
from fastoptim.levels import IMPLS, LEVELS, record_paths, uses_triton
from fastoptim.paths.torch_fused import TorchFused
from fastoptim.registry import OPTIMIZERS
from fastoptim.reference import ReferenceLion, reference_class, reference_kwargs

STEPS = 20


def _frozen(params, state_of):
    """Copies of ``params`` and of each one's state (``state_of(p)``), so a shared run cannot be changed."""
    return ([p.detach().clone() for p in params],
            [{k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in state_of(p).items()}
             for p in params])


@lru_cache(maxsize=16)
def _reference_run(name, index, device, steps, none_every):
    """torch.optim's run (``fastoptim.reference`` where torch has no class) of one option set on the test params:
    the params and state after each step. ``set_grads`` draws the grads from the step number alone, so a level's
    run given the same ``set_grads`` calls sees the same grads."""
    spec = OPTIMIZERS[name]
    opts = spec.option_sets[index]
    ref_p = make_params(name=name, device=device)
    ref = reference_class(spec)(two_groups(ref_p, opts), **opts, **reference_kwargs(spec))
    after = []
    for step in range(1, steps + 1):
        set_grads(step, [ref_p], none_every=none_every)
        ref.step()
        after.append(_frozen(ref_p, lambda p: ref.state[p]))
    return after


@lru_cache(maxsize=16)
def _loop_run(name, index, device, steps):
    """The loop level's run of one option set (params and state after each step): level parity's oracle."""
    spec = OPTIMIZERS[name]
    opts = spec.option_sets[index]
    base_p = make_params(name=name, device=device)
    base = spec.cls(two_groups(base_p, opts), impl="loop", **opts)
    after = []
    for step in range(1, steps + 1):
        set_grads(step, [base_p])
        base.step()
        after.append(_frozen(base_p, lambda p: base.state[p]))
    return after


def _assert_state_close(ours, ours_p, expected_states, **tol):
    """``ours``' state of each param against the oracle's (``expected_states``, one dict per param)."""
    for a, sb in zip(ours_p, expected_states, strict=True):
        sa = ours.state[a]
        for k, vb in sb.items():
            if k == "step" or k in ours.rule.host_states:  # host numbers here, 0-d tensors in torch
                assert float(sa[k]) == float(vb), k
            elif isinstance(vb, torch.Tensor):
                assert_state_close(sa[k], vb, msg=f"state {k!r}", **tol)


def _run_against_reference(name, index, level, device, steps, none_every, flat=False, atol=1e-6):
    """``level``'s run against ``_reference_run``: params after every step, state at the end."""
    spec = OPTIMIZERS[name]
    opts = spec.option_sets[index]
    expected = _reference_run(name, index, device, steps, none_every)
    ours_p = make_params(name=name, device=device)
    ours = spec.cls(two_groups(ours_p, opts), impl=level, flat=flat, **opts)
    for step in range(1, steps + 1):
        set_grads(step, [ours_p], none_every=none_every)
        ours.step()
        for i, (a, b) in enumerate(zip(ours_p, expected[step - 1][0], strict=True)):
            torch.testing.assert_close(a, b, atol=atol, rtol=1e-5, msg=lambda m: f"step {step}, param {i}: {m}")
    _assert_state_close(ours, ours_p, expected[-1][1], atol=1e-6, rtol=state_rtol(name, opts))


@pytest.mark.sample(("name", "index"), ("name", "level"))
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,index,level", MATRIX)
def test_matches_reference_every_step(name, index, level, device):
    atol = param_atol(name, OPTIMIZERS[name].option_sets[index])  # (1e-6 but for bf16 Newton-Schulz: conftest)
    _run_against_reference(name, index, level, device, STEPS, none_every=3, atol=atol)


@pytest.mark.sample(("name", "index"), ("name", "level"))
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name,index", CASES)
def test_levels_agree_on_params_and_state(name, index, level, device):
    """Level parity: each level against the loop level, params and state, every step."""
    spec = OPTIMIZERS[name]
    opts = spec.option_sets[index]
    expected = _loop_run(name, index, device, 7)
    other_p = make_params(name=name, device=device)
    other = spec.cls(two_groups(other_p, opts), impl=level, **opts)
    for step in range(1, 8):
        set_grads(step, [other_p])
        other.step()
        base_p, base_state = expected[step - 1]
        assert_params_close(base_p, other_p)
        _assert_state_close(other, other_p, base_state, atol=1e-6, rtol=1e-5)


# --- 16-bit params and state -------------------------------------------------------------------------------

LOW_PRECISION_STEPS = 10
# Every term of each update is several roundings large in 16 bits: a term below the dtype's rounding cannot be
# seen by any test at that precision (Lion with lr 1e-3 and weight decay 0.5 decays a bf16 weight by 0.05% a
# step, an eighth of bf16's rounding, so the decay mostly rounds away). Here lr * weight_decay is 2% or more.
# RMSprop's coupled weight decay is the same ``g + wd*p`` as SGD's and Adam's (covered here); RMSprop squares
# it and divides by the root, so where it cancels in bf16 the divisor's bound reaches 0 and (b) below could no
# longer check 2.6% of the elements (13% under Triton's interpreter): it is left out for RMSprop.
# (each rule's ``low_precision_options``; a rule that declares none runs its last option set)
LOW_PRECISION_OPTIONS = {name: spec.cls.rule.low_precision_options or spec.option_sets[-1]
                         for name, spec in OPTIMIZERS.items()}
# fp16 state: a second moment of a grad below ~2e-4 underflows to fp16's subnormals or to 0, and an eps of 1e-8
# is 0 in fp16, so a per-op step divides by 0. torch's own fp16 test data sets eps=0.1 for this reason; 1e-3
# keeps every intermediate finite here (with 1e-8 this test fails: the steps overflow to inf).
# (each rule's ``fp16_options``)
FP16_OPTIONS = {name: spec.cls.rule.fp16_options for name, spec in OPTIMIZERS.items()}


class _Bounded:
    """A running error bound (Wilkinson): ``v`` is an expression's value in float64 and ``e`` bounds how far
    the same expression, evaluated one operation at a time in a 16-bit dtype from inputs within their own
    ``e``, can be from ``v``. A rule's ``update`` runs on these unchanged (it uses operators and ``prims``),
    so the bound follows the rule's own operation order, the one the loop level rounds after.

    Each operation combines its operands' bounds in the worst case (first order plus the cross term):
      a ± b: ea + eb            a * b: |a| eb + |b| ea + ea eb            a / b: (ea + |a/b| eb) / (|b| - eb)
      sqrt(a): sqrt(a) - sqrt(max(a - ea, 0))     maximum: max(ea, eb)     sign(a): 0 if |a| > ea, else 2
      clamp(a, lo, hi): min(ea, hi - lo)
    and then rounds its result: + u (|v| + e) + s/2, with u = eps/2 the dtype's unit roundoff plus 2^-23 for
    the float32 arithmetic torch uses inside a 16-bit op (and for a host scalar's float32 rounding), and s the
    dtype's smallest subnormal (rounding near 0 is absolute, not relative). A result that may overflow, or a
    divisor that may be 0 (|b| <= eb), has an infinite bound. A level that computes in float32 and rounds once
    (compiled, Triton, torch's fused kernels) is within this bound too: its error is one final rounding."""

    __slots__ = ("v", "e", "fmt")

    def __init__(self, v, e, fmt):
        self.v, self.e, self.fmt = v, e, fmt

    def _lift(self, x):
        return x if isinstance(x, _Bounded) else _Bounded(torch.as_tensor(x, dtype=torch.float64),
                                                          torch.zeros((), dtype=torch.float64), self.fmt)

    def _rounded(self, v, e):
        u, half_subnormal, largest = self.fmt
        e = e + u * (v.abs() + e) + half_subnormal
        e = torch.where(torch.isnan(v) | torch.isnan(e) | (v.abs() + e > largest), torch.inf, e)
        return _Bounded(v, e, self.fmt)

    def __add__(self, other):
        o = self._lift(other)
        return self._rounded(self.v + o.v, self.e + o.e)

    __radd__ = __add__

    def __sub__(self, other):
        o = self._lift(other)
        return self._rounded(self.v - o.v, self.e + o.e)

    def __rsub__(self, other):
        return self._lift(other) - self

    def __mul__(self, other):
        o = self._lift(other)
        return self._rounded(self.v * o.v, self.v.abs() * o.e + o.v.abs() * self.e + self.e * o.e)

    __rmul__ = __mul__

    def __truediv__(self, other):
        o = self._lift(other)
        v = self.v / o.v
        room = o.v.abs() - o.e
        e = torch.where(room > 0, (self.e + v.abs() * o.e) / room.clamp(min=1e-300), torch.inf)
        return self._rounded(v, e)

    def __rtruediv__(self, other):
        return self._lift(other) / self

    def __neg__(self):
        return _Bounded(-self.v, self.e, self.fmt)

    def sqrt(self):
        v = self.v.clamp(min=0).sqrt()
        return self._rounded(v, v - (self.v - self.e).clamp(min=0).sqrt())

    def sign(self):
        same = (self.v.abs() > self.e) | (self.e == 0)
        return _Bounded(self.v.sign(), torch.where(same, 0.0, 2.0).double(), self.fmt)

    def maximum(self, other):
        o = self._lift(other)
        return _Bounded(self.v.maximum(o.v), self.e.maximum(o.e), self.fmt)

    def clamp(self, lo, hi):  # exact; it moves no two values further apart, nor than hi - lo
        lo, hi = float(lo), float(hi)
        return _Bounded(self.v.clamp(lo, hi), self.e.clamp(max=max(hi - lo, 0.0)), self.fmt)


def _rounding_format(dtype, truncating=False):
    """(unit roundoff, half the smallest subnormal, largest finite) of ``dtype``; a truncating conversion (Triton's
    interpreter turns float32 into bf16 by dropping bits) errs by up to a whole spacing instead of half."""
    info = torch.finfo(dtype)
    unit = info.eps if truncating else info.eps / 2
    return unit + 2.0 ** -23, info.smallest_normal * info.eps / 2, info.max


def _per_op_bound(rule, groups, values, errors, grads, steps, fmt):
    """One step of ``rule`` per param as ``_Bounded`` values: from ``values`` (param and state tensors by name,
    float64) within ``errors`` (same keys), with these exact ``grads``. Returns the stepped values and bounds,
    by name, per param (None where the param has no grad). ``fmt``: ``_rounding_format``."""
    out = []
    for i, (group, g) in enumerate(zip(groups, grads)):
        if g is None:
            out.append(None)
            continue

        def bounded(name):
            v = values[i].get(name)
            if v is None:  # a state created on the first step, at its initial value in the param's dtype
                exact = torch.full_like(g, rule.initial_value(name, group), dtype=torch.float64)
                return _Bounded(exact, (exact.to(g.dtype).double() - exact).abs(), fmt)
            return _Bounded(v, errors[i][name], fmt)
        states = [bounded(n) if on else None for n, on in zip(rule.state_names, rule.active(group))]
        zero = torch.zeros_like(g, dtype=torch.float64)
        result = rule.update(bounded("param"), _Bounded(g.double(), zero, fmt), *states,
                             *rule.scalars(group, steps[i], *rule.host_values(values[i], group)), *rule.flags(group))
        out.append({name: r for name, r in zip(("param", *rule.state_names), result) if r is not None})
    return out


def _ulp(x, dtype):
    """The spacing of ``dtype`` at ``x`` (at the smallest normal and below: the subnormal spacing)."""
    info = torch.finfo(dtype)
    magnitude = x.double().abs().clamp(min=info.smallest_normal)
    return torch.exp2(torch.floor(torch.log2(magnitude))) * info.eps


def _snapshot(opt, params):
    """Each param's value and state as float64 copies, by name (``step`` as an int)."""
    out = []
    for p in params:
        entry = {"param": p.detach().double().clone()}
        for k, v in opt.state[p].items():
            entry[k] = int(v) if k == "step" else v.detach().double().clone() if isinstance(v, torch.Tensor) else v
        out.append(entry)
    return out


def _steps_taken(entry):
    """The step count this step will run at (rules without a step count only ask whether it is the first)."""
    if "step" in entry:
        return entry["step"] + 1
    return 1 if len(entry) == 1 else 2


def _round_once_oracle(spec, opts, before, grads, dtype):
    """torch.optim's single-tensor step (Lion: the published loop in float32) computed in float32 from the
    16-bit values in ``before``, rounded once to ``dtype``: what a level that computes in float32 registers and
    stores 16 bits gives, with torch's math instead of the rule's."""
    ps = [torch.nn.Parameter(b["param"].float()) for b in before]
    extra = reference_kwargs(spec) if spec.reference else {"compute_dtype": None}
    ref = reference_class(spec)(two_groups(ps, opts), **opts, **extra)
    for p, b, g in zip(ps, before, grads):
        p.grad = None if g is None else g.float()
        ref.state[p] = {k: torch.tensor(float(v)) if k == "step" or not isinstance(v, torch.Tensor) else v.float()
                        for k, v in b.items() if k != "param"}
    ref.step()
    return [{"param": p.detach().to(dtype), **{k: v.to(dtype) for k, v in ref.state[p].items() if k != "step"}}
            for p in ps]


def _low_precision_grads(step, params, scales, dtype):
    """Grads spanning three decades per element (a scale fixed per element, as real grads keep theirs), so
    eps, the weight decay and lr_decay each dominate somewhere; param 1 has none every third step. Drawn on the
    CPU, put on each param's device."""
    g = torch.Generator().manual_seed(7000 + step)
    grads = [(torch.randn(p.shape, generator=g) * s).to(device=p.device, dtype=dtype) for p, s in zip(params, scales)]
    if step % 3 == 0:
        grads[1] = None
    return grads


def _assert_within(actual, expected, bound, what):
    diff = (actual.double() - expected.double()).abs()
    bad = ~(diff <= bound)
    if bad.any():
        i = int(bad.flatten().nonzero()[0])
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.numel()} elements outside the bound; first: "
                             f"got {actual.flatten()[i].item()!r}, expected {expected.flatten()[i].item()!r}, "
                             f"|diff| {diff.flatten()[i].item():.3g} > bound {bound.flatten()[i].item():.3g}")


@pytest.mark.sample(("name", "dtype"), ("level", "dtype"))
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name", ELEMENTWISE)  # (the per-op bounds run ``update``; staged rules: test_stages.py)
def test_low_precision_params_track_torch(name, level, dtype, device):
    """bf16/fp16 params with state in the param dtype (as torch keeps it), two oracles, every step.

    (a) Tight, one step at a time. From the level's own 16-bit params and state before each step, torch.optim's
    step computed in float32 and rounded once to 16 bits (``_round_once_oracle``) is within half a 16-bit
    spacing of the exact step (plus float32 noise). A level can differ from the exact step by its own rounding:
    one final rounding where it computes in float32 (compiled, Triton, torch's fused kernels), one rounding per
    operation where it runs the rule on 16-bit tensors (loop, foreach). The second is the larger and depends on
    the values (cancellation in ``g + wd*p`` or ``s - c^2`` makes it many spacings of the result), so the bound
    is computed for these very values: ``_per_op_bound`` runs the rule on ``_Bounded`` numbers. The check is
    |level - oracle| <= bound (1 + 1e-3) + spacing(oracle) + 2^-20 (|oracle| + |before|): the level's error,
    the oracle's rounding, and float32 noise on both sides with room. Comparing levels with the loop level
    instead cannot be tight: per-op and round-once arithmetic part by several spacings a step.

    (b) Against float64 over all steps. The same run in float64 (torch.optim, Lion's published loop) from the
    same 16-bit initial values and grads. The bound is (a)'s carried across steps: each step starts from the
    float64 run's values within the previous step's bounds on param and state, so it grows with the number of
    steps and the dtype's epsilon as the rounding actually propagates (for a plain step p <- p - d it is about
    sum over steps of u (2|p| + k|d|), k the operations in d; Lion adds 2 lr where sign's argument is within its
    bound of 0). The float64 run's own rounding (~1e-16) is left out.

    A mutated rule (a dropped weight decay, a wrong eps, an ignored lr_decay) moves the level away from torch's
    math while its bound stays the size of a rounding, so both checks fail on it."""
    spec = OPTIMIZERS[name]
    rule = spec.cls.rule
    opts = {**LOW_PRECISION_OPTIONS[name], **(FP16_OPTIONS.get(name, {}) if dtype == torch.float16 else {})}
    params = make_params(name=name, dtype=dtype, device=device)
    g = torch.Generator().manual_seed(11)
    scales = [torch.pow(10.0, torch.empty(p.shape).uniform_(-3, 0, generator=g)) for p in params]
    opt = spec.cls(two_groups(params, opts), impl=level, **opts)
    groups = [grp for grp in opt.param_groups for _ in grp["params"]]
    # under TRITON_INTERPRET=1 the fused level runs Triton's interpreter on these CPU tensors, which truncates
    # float32 to bf16 (DESIGN.md); a GPU rounds to nearest
    fmt = _rounding_format(dtype, truncating=level == "fused" and dtype == torch.bfloat16 and device == "cpu"
                           and uses_triton(torch.device("cpu")))
    exact_p = [torch.nn.Parameter(p.detach().double()) for p in params]
    extra = reference_kwargs(spec) if spec.reference else {"compute_dtype": torch.float64}
    exact = reference_class(spec)(two_groups(exact_p, opts), **opts, **extra)
    # (b)'s bounds start at what the 16-bit run already rounded: Adagrad's initial_accumulator_value
    errors = []
    for p, q in zip(params, exact_p):
        ours_state, exact_state = opt.state[p], exact.state[q]
        errors.append({"param": torch.zeros_like(q, dtype=torch.float64),
                       **{k: (ours_state[k].double() - v.double()).abs() for k, v in exact_state.items()
                          if k != "step" and isinstance(v, torch.Tensor)}})
    unbounded, bounded = [0, 0], 0  # infinite bounds in (a) and (b); bounds in each
    for step in range(1, LOW_PRECISION_STEPS + 1):
        grads = _low_precision_grads(step, params, scales, dtype)
        before = _snapshot(opt, params)
        steps = [_steps_taken(b) for b in before]
        oracle = _round_once_oracle(spec, opts, before, grads, dtype)
        zero = [{k: torch.zeros_like(v) for k, v in b.items() if isinstance(v, torch.Tensor)} for b in before]
        one_step = _per_op_bound(rule, groups, before, zero, grads, steps, fmt)
        exact_before = _snapshot(exact, exact_p)
        carried = _per_op_bound(rule, groups, exact_before, errors, grads, steps, fmt)
        for p, q, grad in zip(params, exact_p, grads):
            p.grad = grad
            q.grad = None if grad is None else grad.double()
        opt.step()
        exact.step()
        after, exact_after = _snapshot(opt, params), _snapshot(exact, exact_p)
        for i, p in enumerate(params):
            if one_step[i] is None:
                continue
            for key, b in one_step[i].items():
                where = f"step {step}, param {i}, {key}"
                unbounded[0] += int((~torch.isfinite(b.e)).sum())
                unbounded[1] += int((~torch.isfinite(carried[i][key].e)).sum())
                bounded += b.e.numel()
                o = oracle[i][key]
                noise = 2.0 ** -20 * (o.double().abs() + before[i].get(key, 0 * o).abs())
                tol = b.e * (1 + 1e-3) + _ulp(o, dtype) + noise
                _assert_within(after[i][key], o, tol, f"(a) one step vs torch in float32 rounded once: {where}")
                errors[i][key] = carried[i][key].e
                _assert_within(after[i][key], exact_after[i][key], carried[i][key].e,
                               f"(b) {step} steps vs float64: {where}")
    # An infinite bound (an intermediate may overflow, a divisor may be 0) checks nothing but NaN. Many of them
    # mean the hyper-parameters do not suit the dtype (fp16 with eps=1e-8: sqrt(v) underflows to 0 wherever
    # grads are small). A few come from cancellation the bound cannot see through: where g + wd*p is near 0,
    # Adam's m and sqrt(v) are both small and their ratio stays finite, but the bound of each alone does not
    # (measured: (b) 0.2% of Adam's bf16 bounds, 1.2% under the interpreter's truncation; (a) 1 bound in 5908).
    assert unbounded[0] <= 0.01 * bounded, f"(a): {unbounded[0]} of {bounded} one-step bounds are infinite"
    assert unbounded[1] <= 0.02 * bounded, f"(b): {unbounded[1]} of {bounded} carried bounds are infinite"
    for p in params:
        assert p.dtype == dtype
        for k, v in opt.state[p].items():
            if isinstance(v, torch.Tensor) and k != "step":
                assert v.dtype == dtype, (name, k)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name", ["sgd", "adam", "rmsprop", "adagrad"])
def test_complex_params_match_torch(name, level, device):
    spec = OPTIMIZERS[name]
    opts = spec.option_sets[1]
    g = torch.Generator().manual_seed(3)
    ours_p = [torch.nn.Parameter(torch.randn(4, 3, dtype=torch.complex64, generator=g).to(device))]
    ref_p = clone_params(ours_p)
    ours = spec.cls(ours_p, impl=level, **opts)
    ref = reference_class(spec)(ref_p, **opts, **reference_kwargs(spec))
    for _ in range(5):
        grad = torch.randn(4, 3, dtype=torch.complex64, generator=g).to(device)
        ours_p[0].grad, ref_p[0].grad = grad.clone(), grad.clone()
        ours.step()
        ref.step()
        torch.testing.assert_close(ours_p[0], ref_p[0], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", ["sgd", "adam", "adamw", "rmsprop", "adagrad"])
def test_group_mixing_real_and_complex_params_matches_torch(name, impl):
    """One group of fp32 and complex64 params (a real one first): torch.optim steps the complex one as its
    ``view_as_real`` pair. A complex param's real view is fp32 too, but it steps in a bucket of its own (its grad
    needs the same view), so each level runs its path once per bucket."""
    spec = OPTIMIZERS[name]
    opts = spec.option_sets[1]  # (SGD: with momentum)
    g = torch.Generator().manual_seed(3)
    dtypes = (torch.float32, torch.complex64, torch.float32)
    ours_p = [torch.nn.Parameter(torch.randn(shape, dtype=dtype, generator=g))
              for shape, dtype in zip([(4, 3), (5,), (2, 3)], dtypes)]
    ref_p = clone_params(ours_p)
    ours = spec.cls(ours_p, impl=impl, **opts)
    ref = reference_class(spec)(ref_p, **opts, **reference_kwargs(spec))
    rule = spec.cls.rule
    path = ("loop" if impl == "loop" else impl if impl in ("foreach", "compiled")  # (tests: each level its own path)
            else "torch_fused" if TorchFused.declared(rule, torch.float32) else "foreach")
    for _ in range(5):
        for a, b in zip(ours_p, ref_p):
            a.grad = torch.randn(a.shape, dtype=a.dtype, generator=g)
            b.grad = a.grad.clone()
        with record_paths() as paths:
            ours.step()
        ref.step()
        assert paths == [path, path]
        assert_params_close(ours_p, ref_p)
        for a, b in zip(ours_p, ref_p):
            for key, value in ref.state[b].items():
                if key != "step" and isinstance(value, torch.Tensor):
                    assert_state_close(ours.state[a][key], value, msg=f"state {key!r}")


def test_lion_reference_is_not_trivially_equal():
    """Guard on the Lion oracle: a different beta1 must produce different params (the check can fail)."""
    spec = OPTIMIZERS["lion"]
    a_p = make_params()
    b_p = clone_params(a_p)
    a = spec.cls(a_p, lr=1e-2)
    b = reference_class(spec)(b_p, lr=1e-2, betas=(0.5, 0.99))
    for step in range(1, 4):
        set_grads(step, [a_p, b_p], none_every=100)
        a.step()
        b.step()
    assert any(not torch.allclose(x, y) for x, y in zip(a_p, b_p) if x.numel())


@pytest.mark.parametrize("level", LEVELS)
def test_lion_levels_compute_the_fp32_published_loop_and_differ_from_float64_by_sign_flips(level):
    """Why Lion's exactness oracle is the published loop in the param dtype, and float64 only a closeness one
    (``fastoptim curves``): where b1*m + (1-b1)*g is within a rounding of 0, float32 and float64 give it
    different signs and the weight moves 2*lr apart. After a first step with g = 100, m = 1 exactly; then
    g = -9 makes b1*m + (1-b1)*g exactly 0 in real arithmetic, 0.9f - 0.90000004f = -6e-8 in float32 and
    +2e-16 in float64. lr = 2^-10 keeps every other rounding out of the way."""
    lr = 2.0 ** -10

    def run(make):
        p = torch.nn.Parameter(torch.zeros(3))
        opt = make([p])
        for grad in ([100.0, 100.0, 100.0], [-9.0, 1.0, -1.0]):
            p.grad = torch.tensor(grad)
            opt.step()
        return p.detach()
    ours = run(lambda ps: OPTIMIZERS["lion"].cls(ps, impl=level, lr=lr))
    fp32 = run(lambda ps: ReferenceLion(ps, lr=lr, compute_dtype=None))
    fp64 = run(lambda ps: ReferenceLion(ps, lr=lr))
    assert torch.equal(ours, fp32), (ours, fp32)
    assert fp32.tolist() == [0.0, -2 * lr, -2 * lr] and fp64.tolist() == [-2 * lr, -2 * lr, -2 * lr], (fp32, fp64)


@pytest.mark.sample("name", "level")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_cache_blocked_large_tensors_match_torch(name, level, device):
    """Tensors larger than a CPU block run piece by piece; contiguous, transposed and ragged sizes (for Muon,
    matrices of the same sizes)."""
    from fastoptim.paths.blocking import BLOCK_NUMEL
    spec = OPTIMIZERS[name]
    opts = spec.option_sets[1]
    g = torch.Generator().manual_seed(5)
    tensors = [torch.randn(shape_for(name, (3 * BLOCK_NUMEL + 17,)), generator=g),
               torch.randn(BLOCK_NUMEL // 7, 9, generator=g).t(), torch.randn(shape_for(name, (5,)), generator=g)]
    ours_p = [torch.nn.Parameter(t.to(device)) for t in tensors]
    ref_p = clone_params(ours_p)
    ours = spec.cls(ours_p, impl=level, **opts)
    ref = reference_class(spec)(ref_p, **opts, **reference_kwargs(spec))
    for _ in range(3):
        for a, b in zip(ours_p, ref_p):
            a.grad = torch.randn(a.shape, generator=g).to(device)
            b.grad = a.grad.clone()
        ours.step()
        ref.step()
    assert_params_close(ours_p, ref_p)


@pytest.mark.sample(("name", "index"), ("name", "level"))
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,index,level", [(n, i, lv) for n, i, lv in MATRIX if n in FLAT])
def test_flat_mode_matches_reference_every_step(name, index, level, device):
    """flat=True: params, grads and states as views of one buffer per bucket; same numbers as torch.
    (Every param has a grad here; None grads: tests/engine/test_flat_semantics.py.) Adafactor refuses flat=True
    (test_adafactor_refuses_flat_mode)."""
    _run_against_reference(name, index, level, device, 10, none_every=10 ** 9, flat=True)


@pytest.mark.parametrize("level", LEVELS)
def test_adafactor_refuses_flat_mode(level):
    """Adafactor's row and column factors are not param-shaped, so they cannot be views of one flat buffer."""
    params = make_params(name="adafactor")
    with pytest.raises(ValueError, match="flat=True"):
        OPTIMIZERS["adafactor"].cls(params, impl=level, flat=True, lr=1e-2)
