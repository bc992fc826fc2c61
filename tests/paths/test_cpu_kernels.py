"""The fused level's CPU kernel for 16/8/4-bit state (``fastoptim.paths.cpu_kernel``).

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
from fastoptim import native, storage
from fastoptim.paths import cpu_kernel as kernel_path
from fastoptim.levels import record_paths
from fastoptim.paths.cpu_kernel import kernels as cpu_kernels
from conftest import ELEMENTWISE_CASES, STORED, quantized, same_random_grads  # noqa: E402
from fastoptim.registry import OPTIMIZERS

# Kernel tests: the elementwise kernels run a rule's ``update``, which staged rules (Muon, Adafactor) do not have:
# they never run these kernels, and their stages are tested in tests/paths/test_stages.py. Hence ELEMENTWISE here.

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


CONFIGS = ELEMENTWISE_CASES


@pytest.mark.sample(("name", "option"), "bits")
@pytest.mark.parametrize("bits", STORED)
@pytest.mark.parametrize("name,option", CONFIGS)
def test_the_kernel_gives_the_rules_ieee_math_on_the_stored_values_byte_for_byte(name, option, bits, shapes=SHAPES):
    spec = OPTIMIZERS[name]
    options = dict(spec.option_sets[option])
    g = torch.Generator().manual_seed(option)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    try:
        opt = spec.cls(params, impl="fused", state_bits=bits, min_quant_size=0, **options)
    except ValueError as e:  # centered RMSprop refuses 8/4 bits by name (tested in test_low_bit)
        assert quantized(bits) and "centered" in str(e)
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


@pytest.mark.parametrize("bits", STORED)
def test_a_negative_zero_scalar_is_negative_zero_in_every_lane(bits):
    """lr = -0.0 (which SGD takes): -0.0 - lr * g is +0.0, as the loop level and torch give it, in the elements
    the kernel runs on lanes as in a row's last few (a broadcast that adds 0 makes the scalar +0.0)."""
    results = {}
    for impl in ("fused", "loop"):
        p = torch.nn.Parameter(torch.full((2, 40), -0.0))
        opt = fastoptim.SGD([p], impl=impl, state_bits=bits, min_quant_size=0, lr=-0.0, momentum=0.9)
        p.grad = torch.ones(2, 40)
        with record_paths() as paths:
            opt.step()
        assert ("cpu_kernel" in paths) == (impl == "fused"), paths
        results[impl] = torch.signbit(p.detach())
    assert torch.equal(results["fused"], results["loop"]) and not results["loop"].any()


def _sgd_returning(state):
    """SGD's update with its momentum buffer set to ``state`` (a number, or the name of a scalar)."""
    def update(p, g, momentum_buffer, lr, momentum, weight_decay, buffer_decay, grad_weight,
               MAXIMIZE, WEIGHT_DECAY, MOMENTUM, NESTEROV):
        return p - lr * g, momentum if state == "momentum" else state
    return update


@pytest.mark.parametrize("state", [0.5, -0.0, "momentum"])
@pytest.mark.parametrize("bits", STORED)
def test_a_rule_that_returns_a_number_for_a_state_gets_it_in_every_element(bits, state, monkeypatch):
    """A rule may return a number (or a step scalar) for a state: each lane takes it, not only the first, and the
    kernel builds for it (no staged fallback)."""
    monkeypatch.setattr(OPTIMIZERS["sgd"].cls.rule, "update", staticmethod(_sgd_returning(state)))
    values = {}
    for impl in ("fused", "loop"):
        p = torch.nn.Parameter(torch.ones(3, 40))
        opt = fastoptim.SGD([p], impl=impl, state_bits=bits, min_quant_size=0, lr=0.1, momentum=0.9)
        for _ in range(2):
            p.grad = torch.ones(3, 40)
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # a kernel that would not build warns and runs staged
                with record_paths() as paths:
                    opt.step()
        assert paths == (["cpu_kernel"] if impl == "fused" else ["loop"]), paths
        buffer = opt.state[p]["momentum_buffer"]
        values[impl] = buffer if isinstance(buffer, torch.Tensor) else storage.load(buffer, p.detach())
    assert torch.equal(values["fused"].float().view(torch.int32), values["loop"].float().view(torch.int32))
    want = torch.full((3, 40), 0.9 if state == "momentum" else state)  # as the state's format stores it
    torch.testing.assert_close(values["loop"].float(), want, rtol=1e-2, atol=0)


class _CountingKernel:
    """A built kernel whose entry points count their calls."""

    def __init__(self, lib, calls):
        self.lib, self.calls = lib, calls

    def __getattr__(self, name):
        function = getattr(self.lib, name)

        def counted(*args):
            self.calls.append(name)
            return function(*args)
        return counted


@pytest.mark.parametrize("team", [True, False], ids=["openmp_team", "own_threads"])
@pytest.mark.parametrize("bits", STORED)
def test_enough_blocks_for_every_thread_run_in_chunks_with_the_same_bytes(bits, team, monkeypatch):
    """Enough blocks that two threads take several chunks each (ragged rows between chunks too): on a team of
    the OpenMP runtime torch runs on (its worker threads take the chunks), and on threads of our own."""
    calls = []
    real_kernel = cpu_kernels.kernel
    monkeypatch.setattr(cpu_kernels, "kernel", lambda *args: _CountingKernel(real_kernel(*args), calls))
    if team:
        assert cpu_kernels.omp_parallel() is not None or not (
            sys.platform == "linux" and "OpenMP" in torch.__config__.parallel_info()), \
            "torch runs on OpenMP here, but its runtime's GOMP_parallel was not found"
    else:
        monkeypatch.setattr(cpu_kernels, "omp_parallel", lambda: None)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(threads, 2))
    try:
        shapes = [(300, 256), (200, 129), (7, 1000)]
        test_the_kernel_gives_the_rules_ieee_math_on_the_stored_values_byte_for_byte("adamw", 0, bits, shapes)
    finally:
        torch.set_num_threads(threads)
    ran = "fo_step_team" if team and cpu_kernels.omp_parallel() is not None else "fo_step"
    assert calls and set(calls) == {ran}, calls
    if ran == "fo_step":
        assert len(calls) >= 2 * 4, "the steps' blocks were not split into chunks"


@pytest.mark.parametrize("bits", STORED)
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
        same_random_grads(params, twin, g)
        with record_paths() as paths:
            opt.step()
        ref.step()
        assert "cpu_kernel" in paths and len(paths) > 1, paths
    for a, b in zip(params, twin):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("in_place", [False, True])
def test_the_kernels_table_follows_new_grads_and_a_grad_that_stops_being_contiguous(in_place):
    """The table of a bucket is made once; each step's grads may be new tensors (new addresses), written in
    place, or strided (that param then runs staged, and the kernel takes it back when its grad is contiguous)."""
    g = torch.Generator().manual_seed(6)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in [(64, 128), (96, 40), (40, 96)]]
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = fastoptim.AdamW(params, impl="fused", state_bits=8, min_quant_size=0)
    ref = fastoptim.AdamW(twin, impl="loop", state_bits=8, min_quant_size=0)
    for step in range(5):
        for i, (a, b) in enumerate(zip(params, twin)):
            grad = torch.randn(a.shape, generator=g)
            if step == 2 and i == 1:  # a strided grad with the param's shape
                grad = torch.randn(tuple(reversed(a.shape)), generator=g).t()
            if in_place and a.grad is not None and grad.is_contiguous() and a.grad.is_contiguous():
                a.grad.copy_(grad)
            else:
                a.grad = grad
            b.grad = grad.clone()
        with record_paths() as paths:
            opt.step()
        ref.step()
        assert paths.count("cpu_kernel") == 1 and len(paths) == (2 if step == 2 else 1), (step, paths)
        for a, b in zip(params, twin):
            torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)


def test_without_a_compiler_the_fused_level_warns_once_and_runs_staged(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no c++, g++ or clang++ to be found
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("FASTOPTIM_CACHE", str(tmp_path / "cache"))  # nothing built before
    _fresh_kernels()
    monkeypatch.setattr(kernel_path, "_kernel_warned", set())
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
    for cached in (cpu_kernels.available, cpu_kernels.kernel, cpu_kernels._library, native.target):
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
    monkeypatch.setattr(kernel_path, "_kernel_warned", set())
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


@pytest.mark.slow
def test_a_damaged_cached_kernel_is_built_again(tmp_path):
    """In fresh processes (a loaded library must not be cut short under the process that runs it)."""
    env = dict(os.environ, FASTOPTIM_CACHE=str(tmp_path))
    probe = [sys.executable, "-c", "from fastoptim.paths.cpu_kernel import kernels as cpu_kernels; print(cpu_kernels.available())"]
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

    monkeypatch.setattr(kernel_path, "_kernel_warned", set())
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


# --- the codec's SIMD paths, and the builds without them ------------------------------------------------

# extra compiler flags of each build: this CPU's own (-march=native), then without AVX-512, then without AVX2,
# so the paths kept for other CPUs are built and checked here too
BUILDS = {"native": (), "avx2": ("-mno-avx512f",), "scalar": ("-mno-avx2",)}


def _simd_width_expected(extra) -> int:
    """What ``fo_simd_width()`` must say for a build with these flags, from the compiler's own macros."""
    done = subprocess.run([cpu_kernels.compiler(), "-march=native", *extra, "-dM", "-E", "-x", "c++", os.devnull],
                          capture_output=True, text=True, check=True)
    if all(f"__{isa}__" in done.stdout for isa in ("AVX512F", "AVX512BW", "AVX512VL", "AVX512DQ", "AVX512VBMI")):
        return 512
    return 256 if "__AVX2__" in done.stdout else 0


@pytest.fixture(params=list(BUILDS))
def build(request, monkeypatch):
    """Kernels built with this build's flags (and the width its code must report)."""
    extra = BUILDS[request.param]
    monkeypatch.setattr(cpu_kernels, "CXXFLAGS", cpu_kernels.CXXFLAGS + extra)
    _fresh_kernels()
    yield _simd_width_expected(extra)
    _fresh_kernels()


def _codec_kernel(bits):
    """A kernel whose state 0 is signed and state 1 unsigned at ``bits`` (Adam's exp_avg and exp_avg_sq)."""
    from fastoptim.rules.adam import adam_update

    codec = storage.codecs.for_bits(bits)
    formats = (codec.format(True), codec.format(False), None)
    return cpu_kernels.kernel(adam_update, (False, True, True, False), formats, 8), formats


def _hard_values(fmt, g):
    """Values whose codes are easy to get wrong: every rounding boundary and its fp32 neighbours, every code's
    value, +-0, tiny and subnormal values, values in every octave of the encoder's range, random ones; as
    fractions of the block's largest value."""
    if fmt.codec is None:  # the dynamic maps
        bounds, table = fmt.qmap.boundaries(), fmt.qmap.table()
    else:  # a float format's values over its largest, and the midpoints between them
        number = storage.codecs.of(fmt).minifloat(fmt)
        table = number.decode(torch.arange(256)) / number.max_value
        table = table[table.isfinite()].unique()
        bounds = (table[1:] + table[:-1]) / 2
    near = torch.cat([bounds, torch.nextafter(bounds, torch.tensor(2.0)), torch.nextafter(bounds, torch.tensor(-2.0))])
    octaves = torch.tensor([2.0 ** -e for e in range(0, 40)]) * (1 + torch.rand(40, generator=g))
    special = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e-40, -1e-40, 1.0, -1.0])
    values = torch.cat([near, table, special, octaves, -octaves, torch.randn(600, generator=g) * 0.3])
    return values.clamp(-1.0, 1.0)


def _blocks(values, block, g):
    """Blocks of ``block`` values, each holding a 1.0 (so the quotient is the value itself), then the same values
    at a random scale (a real division), and blocks with a NaN, an inf, all zeros, and ragged lengths."""
    chunk = block - 1
    out = []
    for at in range(0, values.numel(), chunk):
        piece = values[at:at + chunk]
        out.append(torch.cat([torch.ones(1), piece]))
        out.append(torch.cat([-torch.ones(1), piece]) * float(torch.rand(1, generator=g) * 5 + 0.01))
    out.append(torch.cat([torch.tensor([float("nan"), -float("nan")]), values[:block - 2]]))
    out.append(torch.cat([torch.tensor([float("inf"), -3.0]), values[:block - 2]]))
    out.append(torch.zeros(block))
    out.append(values[:block] * 1e-37)  # a block's absmax far below 1: its scale's inverse overflows fp32
    out.append(torch.cat([torch.tensor([1e10]), values[:block - 1].abs() * 1e-30]))  # quotients that underflow
    out += [values[:n] * 0.7 for n in (1, 3, 17, 63, 65, block - 1)]
    return out


@pytest.mark.parametrize("bits", [key for key in storage.codecs.keys() if storage.codecs.for_bits(key).quantized])
def test_the_kernels_codec_gives_the_eager_codecs_codes_and_values(build, bits):
    """Each build's encoder and decoder (the SIMD paths: AVX-512 cell tables and byte permutes, the 4-bit
    search and the linear map's formula; AVX2 gathers; the float formats' integer operations; scalar) on hard
    values, block by block, against the codec's own span encode and decode (``quant.quantize`` and
    ``quant.dequantize`` for the dynamic maps)."""
    import ctypes

    lib, formats = _codec_kernel(bits)
    assert lib.fo_simd_width() == build
    _, maps = cpu_kernels._map_pointers(formats)
    g = torch.Generator().manual_seed(7)
    for k, fmt in enumerate(formats[:2]):
        codec, width = storage.codecs.of(fmt), fmt.bits
        for x in _blocks(_hard_values(fmt, g), fmt.block, g):
            x = x.float().contiguous()
            n = x.numel()
            codes = torch.zeros((n + 1) // 2 if width == 4 else n, dtype=torch.uint8)
            absmax = torch.zeros(1)
            lib.fo_codec(maps, k, ctypes.c_void_p(x.data_ptr()), n, ctypes.c_void_p(codes.data_ptr()),
                         ctypes.c_void_p(absmax.data_ptr()), None)
            want_codes, want_absmax = codec.encode_span(x.reshape(1, n), fmt)
            if width == 4:
                want_codes = storage.quant.pack4(want_codes)
            torch.testing.assert_close(absmax, want_absmax.reshape(1), rtol=0, atol=0, equal_nan=True)
            assert torch.equal(codes, want_codes.reshape(-1)), (fmt.tag, n)
            values = torch.zeros(n)
            lib.fo_codec(maps, k, None, n, ctypes.c_void_p(codes.data_ptr()), ctypes.c_void_p(absmax.data_ptr()),
                         ctypes.c_void_p(values.data_ptr()))
            unpacked = storage.quant.unpack4(codes.reshape(1, -1), n) if width == 4 else codes.reshape(1, n)
            want = codec.decode_span(unpacked, absmax.reshape(1, 1), fmt)
            torch.testing.assert_close(values, want.reshape(-1), rtol=0, atol=0, equal_nan=True)


def test_every_code_decodes_to_its_map_value_times_absmax(build):
    import ctypes

    for bits in (8, 4):
        lib, formats = _codec_kernel(bits)
        _, maps = cpu_kernels._map_pointers(formats)
        for k, fmt in enumerate(formats[:2]):
            codes = torch.arange(2 ** bits, dtype=torch.uint8).repeat(fmt.block // 2 ** bits or 1)
            codes = (codes[0::2] | (codes[1::2] << 4)) if bits == 4 else codes
            n = fmt.block
            absmax = torch.tensor([0.37])
            values = torch.zeros(n)
            lib.fo_codec(maps, k, None, n, ctypes.c_void_p(codes.data_ptr()), ctypes.c_void_p(absmax.data_ptr()),
                         ctypes.c_void_p(values.data_ptr()))
            index = torch.arange(n) % 2 ** bits
            assert torch.equal(values, fmt.qmap.table()[index] * absmax), fmt.tag


def _fp8_layouts():
    """fp8 codecs of every Minifloat layout (the shipped one, and 5-bit exponents: fp16 does not hold those)."""
    from fastoptim.storage.codecs import fp8

    return [("shipped", None), ("e5m2+ue5m3", fp8.Fp8("fp8_test_e5m2", (), fp8.E5M2, fp8.UE5M3))]


@pytest.mark.parametrize("key", ["dynamic8", *[name for name, _ in _fp8_layouts()]])
def test_every_8_bit_code_decodes_as_the_codec_decodes_it_at_any_scale(build, key):
    """All 256 codes, codes the encoder never gives included, bit for bit (signs of zero and NaNs too) at scales
    whose products underflow, overflow, are exact or not numbers, over whole lanes and a block's last few; every
    fp8 layout (the F16C decode places a code as an fp16 number, which holds 4-bit exponents only)."""
    import ctypes

    codec = dict(_fp8_layouts())[key] if key != "dynamic8" else None
    if codec is not None:
        storage.codecs.register(codec)
    try:
        lib, formats = _codec_kernel(8 if key == "dynamic8" else codec.key if codec else "fp8_e4m3")
        _, maps = cpu_kernels._map_pointers(formats)
        for k, fmt in enumerate(formats[:2]):
            for n in (256, 19):
                codes = torch.arange(256, dtype=torch.uint8).roll(-37 * (n != 256))[:n]
                for scale in (0.37, 1.0, 3e-38, 1e-45, 3e38, 0.0, float("inf"), float("nan"), -float("nan")):
                    absmax = torch.tensor([scale])
                    values = torch.zeros(n)
                    lib.fo_codec(maps, k, None, n, ctypes.c_void_p(codes.data_ptr()),
                                 ctypes.c_void_p(absmax.data_ptr()), ctypes.c_void_p(values.data_ptr()))
                    want = storage.codecs.of(fmt).decode_span(codes.reshape(1, n), absmax.reshape(1, 1), fmt)
                    got, want = values.view(torch.int32), want.reshape(-1).contiguous().view(torch.int32)
                    finite = ~torch.isnan(want.view(torch.float32))
                    assert torch.equal(got[finite], want[finite]), (fmt.tag, n, scale)
                    assert torch.isnan(values[~finite]).all(), (fmt.tag, n, scale)
    finally:
        if codec is not None:
            storage.codecs.unregister(codec)


@pytest.mark.parametrize("bits", STORED)
def test_each_build_steps_byte_for_byte_like_the_oracle(build, bits):
    """The whole step (not only the codec) in each build, for two rules whose states use both maps."""
    for name in ("adamw", "lion"):
        test_the_kernel_gives_the_rules_ieee_math_on_the_stored_values_byte_for_byte(name, 0, bits)
        from fastoptim.rules.adam import adam_update

        assert cpu_kernels.kernel(adam_update, (False, True, True, False), (storage.Format(8, True),
                                  storage.Format(8, False), None), 8).fo_simd_width() == build


def test_the_cell_tables_cover_the_8_bit_maps_and_hold_one_boundary_a_cell():
    """The AVX-512 encoder's tables exist for both 8-bit maps (else it reads the encoder's table lane by lane: slower)."""
    for signed in (True, False):
        qmap = storage.quant.dynamic(8, signed)
        tables = cpu_kernels.cell_tables(qmap)
        assert tables is not None, qmap.name
        octaves, cells, bounds = tables
        assert len(octaves) == 64 and len(cells) == 512 and len(bounds) == 256 and bounds[-1] == 2.0
        assert all(0 <= c <= 255 for c in cells)


def test_a_grad_of_another_dtype_after_the_first_step_is_not_read_as_fp32():
    """torch takes a bf16 grad for an fp32 param where ``p.grad_dtype = None``: the kernel's table, made for fp32
    grads, must never be pointed at it (it would read twice its bytes); the step takes it in the param's dtype,
    as the loop level's arithmetic promotes it."""
    init = torch.randn(64, 96, generator=torch.Generator().manual_seed(8))
    runs = {}
    for impl in ("fused", "loop"):
        p = torch.nn.Parameter(init.clone())
        p.grad_dtype = None
        opt = fastoptim.AdamW([p], lr=1e-2, impl=impl, state_bits=8, min_quant_size=0)
        g = torch.Generator().manual_seed(9)
        for step in range(4):
            grad = torch.randn(p.shape, generator=g)
            p.grad = grad if step in (0, 3) else grad.to(torch.bfloat16)
            with record_paths() as paths:
                opt.step()
            if impl == "fused":
                assert paths == ["cpu_kernel"], (step, paths)
        runs[impl] = p.detach()
    assert torch.isfinite(runs["fused"]).all()
    torch.testing.assert_close(runs["fused"], runs["loop"], rtol=1e-5, atol=1e-6)


# the AVX-512 build's instruction sets, named outright: a machine without them (a Zen 3, say) still compiles it
AVX512_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vbmi")


@pytest.mark.parametrize("bits", (8, 4))
def test_the_avx512_build_compiles_on_any_machine_with_its_byte_permutes(bits, tmp_path):
    """Where this CPU lacks AVX-512 the builds above cannot run it, so its source is at least compiled here for
    those instruction sets (as for a Zen 4): it must build, say 512 bits, and use the codec's byte permutes (8
    bits: VBMI two-table permutes; 4 bits: the one-register permute of the map)."""
    from fastoptim.rules.adam import adam_update

    formats = (storage.codecs.for_bits(bits).format(True), storage.codecs.for_bits(bits).format(False), None)
    source = tmp_path / "kernel.cpp"
    source.write_text(cpu_kernels.kernel_source(adam_update, (False, True, True, False), formats, 8))
    flags = [f for f in cpu_kernels.CXXFLAGS if f not in ("-shared", "-fPIC")]
    done = subprocess.run([cpu_kernels.compiler(), *flags, *AVX512_FLAGS, "-S", str(source), "-o", "-"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assembly = done.stdout
    width = assembly[assembly.index("fo_simd_width:"):][:400]
    assert "$512" in width
    if bits == 8:
        assert "vpermt2b" in assembly or "vpermi2b" in assembly
    else:
        assert "vpermps" in assembly and "zmm" in assembly
