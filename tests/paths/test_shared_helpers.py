"""Helpers an update calls (``rules.common``) at every level: the torch levels call them, the C++ twin traces
through them, and the Triton twin jits each as a twin of its own (its ``/`` rewritten, its flags constant),
which Triton inlines. SGD's rule, its update swapped for one built of helpers (one calling another, one
dividing, a flag passed on by keyword), steps bit for bit as its loop level at every level."""

import re

import pytest
import torch

import fastoptim
from fastoptim import storage
from fastoptim.levels import record_paths
from fastoptim.paths.cpu_kernel import kernels as cpu_kernels
from fastoptim.registry import OPTIMIZERS
from fastoptim.rules.common import maximize_and_decay

SGD = OPTIMIZERS["sgd"].cls.rule
OPTIONS = dict(lr=0.05, momentum=0.9, weight_decay=0.1, maximize=True)  # MAXIMIZE, WEIGHT_DECAY, MOMENTUM on
SHAPE = (64, 300)  # large enough for the compiled level to take


def _ratio(a, b, NEGATE):
    """A helper that divides (IEEE division in the Triton twin too) and branches on a flag."""
    if NEGATE:
        a = -a
    return a / b


def _buffered(g, momentum_buffer, p, buffer_decay, NEGATE):
    """A helper that calls another."""
    return momentum_buffer * buffer_decay + _ratio(g, p * p + 1.0, NEGATE=NEGATE)


def helper_update(p, g, momentum_buffer, lr, momentum, weight_decay, buffer_decay, grad_weight,
                  MAXIMIZE, WEIGHT_DECAY, MOMENTUM, NESTEROV):
    p, g = maximize_and_decay(p, g, weight_decay, None, MAXIMIZE, WEIGHT_DECAY, DECOUPLED=False)
    momentum_buffer = _buffered(g, momentum_buffer, p, buffer_decay, NEGATE=MOMENTUM)
    return p - lr * momentum_buffer, momentum_buffer


@pytest.fixture(autouse=True)
def helper_sgd(monkeypatch):
    monkeypatch.setattr(SGD, "update", helper_update)


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _steps(impl: str, bits=32):
    """The param and momentum buffer (fp32) after three steps at ``impl``, and the paths of the last."""
    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(SHAPE, generator=g))
    opt = fastoptim.SGD([p], impl=impl, state_bits=bits, min_quant_size=0, **OPTIONS)
    for _ in range(3):
        p.grad = torch.randn(SHAPE, generator=g)
        with record_paths() as paths:
            opt.step()
    buffer = opt.state[p]["momentum_buffer"]
    buffer = buffer.float() if isinstance(buffer, torch.Tensor) else storage.load(buffer, p.detach())
    return p.detach().clone(), buffer, paths


def _assert_same_bits(got, want):
    for a, b in zip(got[:2], want[:2]):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("impl", ["foreach", "compiled"])
def test_torch_levels_call_the_helpers(impl):
    got = _steps(impl)
    assert got[2] == [impl]
    _assert_same_bits(got, _steps("loop"))


@pytest.mark.skipif(cpu_kernels.available() is not None, reason=f"no C++ toolchain: {cpu_kernels.available()}")
@pytest.mark.parametrize("bits", [16, 8])
def test_the_cpp_twin_traces_through_the_helpers(bits):
    got = _steps("fused", bits)
    assert got[2] == ["cpu_kernel"]
    _assert_same_bits(got, _steps("loop", bits))


@pytest.mark.parametrize("bits", [32, 8])
def test_the_triton_twin_calls_twins_of_the_helpers(interpret, bits):
    pytest.importorskip("triton")
    got = _steps("fused", bits)
    assert got[2] == ["triton" if bits == 32 else "triton_stored"]
    _assert_same_bits(got, _steps("loop", bits))


def test_the_triton_twin_inlines_the_helpers_for_a_gpu():
    pytest.importorskip("triton")
    from fastoptim.paths.triton import kernels as tk

    compiled = tk.compile_for_gpu(SGD, {**SGD.defaults, **OPTIONS}, torch.float32, 90)
    assert "tt.call" not in compiled.asm["ttir"]  # inlined: one function, the kernel
    ptx = compiled.asm["ptx"]
    assert re.search(r"\bdiv\.rn\.f32\b", ptx) and not re.search(r"\bdiv\.(full|approx)\.", ptx)
    assert tk.triton_twin(helper_update, False).fn.__globals__["_buffered"] is tk.triton_twin(_buffered, False)
