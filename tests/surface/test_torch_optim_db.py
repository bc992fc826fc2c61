"""torch's own optimizer test data, run against fastoptim as a drop-in for torch.optim.

``torch.testing._internal.common_optimizers.optim_db`` holds, per torch.optim class, the constructor inputs
torch's test suite samples (``optim_inputs_func``) and the inputs it expects to be refused, with the
exception (or warning) type and message (``optim_error_inputs_func``). For every fastoptim optimizer that has
a torch.optim counterpart, at every level:

* error inputs: fastoptim refuses the same input with the same exception type as torch (read from torch
  itself, and checked against the type the data states), with a message that names the problem;
* sample inputs: three steps with those keyword arguments give the same params and state as torch.optim's
  single-tensor path (``foreach=False``), to the fp32 tolerance of DESIGN.md (atol 1e-6, rtol 1e-5); Muon, whose
  torch class steps one tensor at a time and always runs Newton-Schulz in bf16, against torch.optim.Muon itself
  where fastoptim picks bf16 too (the bf16 tolerance of conftest.MUON_BF16_ATOL), else against
  ``fastoptim.reference.ReferenceMuon`` (torch's loop with fp32 products).

What is left out is listed below with its reason; anything new in torch's data runs (and fails loudly where
fastoptim differs) instead of being skipped.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch

from conftest import (assert_state_close, clone_params, make_params, newton_schulz_in_bf16, param_atol,
                      set_grads)
from fastoptim.levels import LEVELS, PATHS, record_paths
from fastoptim.paths.stages import PER_TENSOR_PATHS
from fastoptim.reference import reference_class
from fastoptim.registry import OPTIMIZERS

pytest.importorskip("expecttest", reason="torch's test data (torch.testing._internal) imports expecttest")
_frozen = torch.backends.flags_frozen()
from torch.testing._internal.common_optimizers import OptimizerErrorEnum, optim_db  # noqa: E402

if not _frozen and torch.backends.flags_frozen():
    # importing torch's test utilities freezes torch.backends flags for the whole process; thaw them again so
    # other tests in this worker are not affected by this module's import
    torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = True

DEVICE = "cpu"
DTYPE = torch.float32
STEPS = 3
INFOS = {info.optim_cls.__name__: info for info in optim_db}

# fastoptim optimizers without a torch.optim class: nothing in torch's data to run
NO_TORCH_COUNTERPART = {
    name: f"torch.optim has no {spec.cls.__name__}; tests/surface/test_parity.py checks it against {spec.oracle}"
    for name, spec in OPTIMIZERS.items() if spec.torch_counterpart is None
}

# Constructor arguments fastoptim does not take, with the reason. None of them is in torch's CPU sample data
# (torch 2.13: capturable appears only in its CUDA/XPU configs, differentiable and fused are added by
# torch's tests, not by the data); a sample input carrying one is skipped with this reason.
UNSUPPORTED_KWARGS = {
    "capturable": "CUDA-graph capture of torch's on-device step counters: fastoptim's levels take tensor "
                  "hyper-parameters and GradScaler's found_inf without host syncs instead",
    "differentiable": "autograd through the optimizer step: fastoptim's steps run under no_grad",
    "decoupled_weight_decay": "Adam(decoupled_weight_decay=True) is fastoptim.AdamW",  # (RAdam, NAdam take it)
}

# Error inputs where fastoptim accepts what torch refuses, on purpose. Each is checked the other way round:
# fastoptim takes the input and steps to torch's single-tensor numbers.
ACCEPTED_BY_DESIGN = {
    "lr as Tensor doesn't work with foreach & not capturable":
        "a tensor lr works at every fastoptim level (foreach=True spells impl='foreach'); torch's "
        "restriction belongs to its foreach path",
    r"betas\[0\] as a Tensor is not supported for capturable=False and foreach=True":
        "tensor betas work at every fastoptim level, foreach included",
    "only support 2D parameters":
        "fastoptim's Muon steps a param of 3+ dims as a batch of matrices or flattened to one (matrices=; "
        "tests/rules/test_muon_matrices.py); 0-d and 1-d params stay refused",
}

# Error messages: torch's regex, or where fastoptim words the same error its own way, what its message
# must say instead (the argument's name and the bad value).
OUR_WORDING = {
    "Invalid beta parameter at index 0: 1.0": r"Invalid beta1 \(betas\[0\]\): 1\.0 \(must be in \[0, 1\)\)",
    "Invalid weight_decay value: -1": r"Invalid weight_decay: -1(\.0)? \(must be >= 0\)",
    "Invalid momentum value: -0.5": r"Invalid momentum: -0\.5 \(must be >= 0\)",
    "Invalid momentum value: -1.0": r"Invalid momentum: -1\.0 \(must be >= 0\)",
    "Invalid lr_decay value: -0.5": r"Invalid lr_decay: -0\.5 \(must be >= 0\)",
    "Invalid beta parameter at index 1: 1.0": r"Invalid beta2 \(betas\[1\]\): 1\.0 \(must be in \[0, 1\)\)",
    "Invalid rho value: 1.1": r"Invalid rho: 1\.1 \(must be in \[0, 1\]\)",
    "Invalid momentum_decay value: -0.2": r"Invalid momentum_decay: -0\.2 \(must be >= 0\)",
    "Invalid weight_decay value: -0.5": r"Invalid weight_decay: -0\.5 \(must be >= 0\)",
    "Invalid eta values: 1.0, 0.5": r"Invalid etas: \(1\.0, 0\.5\) \(must be 0 < etas\[0\] < 1 < etas\[1\]\)",
    "epsilon1 should be >= 0": r"Invalid eps1 \(eps\[0\]\): -1e-30 \(must be >= 0\)",
    "Clipping threshold d should be >= 1": r"Invalid d: 0\.0 \(the clipping threshold must be >= 1\)",
    "beta2_decay should be <= 0": r"Invalid beta2_decay: 0\.8 \(must be <= 0\)",
    "Adjust learning rate function arbitrary is not supported": r"Invalid adjust_lr_fn: 'arbitrary'",
}


def _info(name):
    return INFOS[OPTIMIZERS[name].torch_counterpart]


def _sample_inputs(name):
    return _info(name).optim_inputs_func(device=DEVICE, dtype=DTYPE)


def _error_inputs(name):
    return _info(name).optim_error_inputs_func(device=DEVICE, dtype=DTYPE)


def _oracle(name, params, kwargs):
    """torch's single-tensor path for ``kwargs`` (see the module docstring for Muon's)."""
    spec = OPTIMIZERS[name]
    if spec.reference is not None:
        return getattr(torch.optim, spec.reference)(params, foreach=False, **kwargs)
    if newton_schulz_in_bf16(name, kwargs):
        return getattr(torch.optim, spec.torch_class)(params, **kwargs)
    return reference_class(spec)(params, **kwargs)


def _cases(inputs_of, describe):
    cases = []
    for name in OPTIMIZERS:
        if name in NO_TORCH_COUNTERPART:  # no case at all (not a skipped one): there is nothing to run
            continue
        cases += [pytest.param(name, i, id=f"{name}-{describe(x)}") for i, x in enumerate(inputs_of(name))]
    return cases


SAMPLE_CASES = _cases(_sample_inputs, lambda x: x.desc)
ERROR_CASES = _cases(_error_inputs, lambda x: x.optimizer_error_input.desc)


def test_torch_data_covers_every_optimizer_with_a_counterpart():
    """Guard: the parametrisations above are not silently empty (a renamed torch class, an emptied list)."""
    for name, spec in OPTIMIZERS.items():
        if name in NO_TORCH_COUNTERPART:
            continue
        assert spec.torch_counterpart in INFOS, spec.torch_counterpart
        assert len(_sample_inputs(name)) >= 5, name
        errors = _error_inputs(name)
        assert any(e.optimizer_error_input.desc == "Tensor lr must be 1-element" for e in errors), name


# --- error inputs -------------------------------------------------------------------------------------------

def _outcome(construct, error_on):
    """What constructing (and, for a step error, stepping) does: ("raise", exc, "construction" or "step"),
    ("warn", [warnings]) or ("ok", optimizer)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        when = "construction"
        try:
            opt = construct()
            if error_on == OptimizerErrorEnum.STEP_ERROR:
                when = "step"
                opt.step()
        except Exception as exc:  # the exception is the result under test
            return "raise", exc, when
    return ("warn", list(caught)) if caught else ("ok", opt)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name,index", ERROR_CASES)
def test_error_inputs_raise_what_torch_raises(name, index, level):
    info = _info(name)
    spec = OPTIMIZERS[name]
    theirs_input = _error_inputs(name)[index]  # one fresh copy of the data for each side
    ours_input = _error_inputs(name)[index]
    desc = theirs_input.optimizer_error_input.desc
    if desc in ACCEPTED_BY_DESIGN:
        _check_accepted(name, level, ours_input.optimizer_error_input.kwargs)
        return
    t = theirs_input.optimizer_error_input
    theirs = _outcome(lambda: info.optim_cls(t.params, **t.kwargs), theirs_input.error_on)
    o = ours_input.optimizer_error_input
    ours = _outcome(lambda: spec.cls(o.params, impl=level, **o.kwargs), ours_input.error_on)
    expected, regex = theirs_input.error_type, theirs_input.error_regex

    if issubclass(expected, Warning):
        assert theirs[0] == "warn" and any(issubclass(w.category, expected) for w in theirs[1]), theirs
        assert ours[0] == "warn", f"{desc}: torch warns {expected.__name__}, fastoptim: {ours}"
        messages = [str(w.message) for w in ours[1] if issubclass(w.category, expected)]
        assert any(re.search(regex, m) for m in messages), (desc, messages)
        return
    assert theirs[0] == "raise" and type(theirs[1]) is expected, f"torch's data no longer holds: {theirs}"
    assert ours[0] == "raise", f"{desc}: torch raises {expected.__name__}, fastoptim: {ours}"
    exc = ours[1]
    assert type(exc) is type(theirs[1]), f"{desc}: torch raises {expected.__name__}, fastoptim {exc!r}"
    assert ours[2] == theirs[2], f"{desc}: torch raises at {theirs[2]}, fastoptim at {ours[2]}: {exc!r}"
    wanted = OUR_WORDING.get(regex, regex)
    assert re.search(wanted, str(exc)), f"{desc}: message {str(exc)!r} does not say {wanted!r}"


def _check_accepted(name, level, kwargs):
    spec = OPTIMIZERS[name]
    ours_p = make_params(name=name)
    ref_p = clone_params(ours_p)
    ours = spec.cls(ours_p, impl=level, **kwargs)
    single = {k: v for k, v in kwargs.items() if k != "foreach"}
    ref = _oracle(name, ref_p, _copied(single))
    _run_and_compare(ours, ours_p, ref, ref_p, level, param_atol(name, single))


# --- sample inputs ------------------------------------------------------------------------------------------

def _copied(kwargs):
    """Tensor values (a tensor lr, tensor betas) copied, so neither optimizer sees the other's."""
    def copy(v):
        if isinstance(v, torch.Tensor):
            return v.clone()
        return tuple(copy(x) for x in v) if isinstance(v, tuple) else v
    return {k: copy(v) for k, v in kwargs.items()}


def _run_and_compare(ours, ours_p, ref, ref_p, level, atol=1e-6):
    paths = set()
    for step in range(1, STEPS + 1):
        set_grads(step, [ours_p, ref_p])  # param 1 has no grad at step 3: both must skip it
        with record_paths() as log:
            ours.step()
        paths.update(log)
        ref.step()
        for i, (a, b) in enumerate(zip(ours_p, ref_p)):
            torch.testing.assert_close(a, b, atol=atol, rtol=1e-5, msg=lambda m: f"step {step}, param {i}: {m}")
    for a, b in zip(ours_p, ref_p):
        for key, value in ref.state[b].items():
            if key == "step" or key in ours.rule.host_states:  # host numbers here, 0-d tensors in torch
                assert float(ours.state[a][key]) == float(value), key
            elif isinstance(value, torch.Tensor):
                assert_state_close(ours.state[a][key], value, msg=f"state {key!r}")
    # the level ran the path it names (on the CPU, fused runs torch's fused kernel where there is one), and a
    # staged rule's per-tensor stages that level's batching of them
    assert paths and paths <= set(PATHS), paths
    if ours.rule.stages:
        assert PER_TENSOR_PATHS[level] in paths, paths
        paths.discard(PER_TENSOR_PATHS[level])
    if level in ("loop", "foreach", "compiled"):
        assert paths <= {level}, paths
    else:
        assert "loop" not in paths, paths


@pytest.mark.sample(("name", "index"), "level")
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name,index", SAMPLE_CASES)
def test_sample_inputs_step_like_torch(name, index, level):
    _info(name)
    spec = OPTIMIZERS[name]
    sample = _sample_inputs(name)[index]
    unsupported = sorted(k for k in set(sample.kwargs) & set(UNSUPPORTED_KWARGS) if k not in spec.cls.rule.defaults)
    if unsupported:
        pytest.skip("; ".join(f"{k}: {UNSUPPORTED_KWARGS[k]}" for k in unsupported))
    ours_p = make_params(name=name)
    ref_p = clone_params(ours_p)
    ours = spec.cls(ours_p, impl=level, **_copied(sample.kwargs))
    ref = _oracle(name, ref_p, _copied(sample.kwargs))
    _run_and_compare(ours, ours_p, ref, ref_p, level, param_atol(name, sample.kwargs))


# --- tensor lr cases beyond the data ------------------------------------------------------------------------

TENSOR_LRS = {
    "empty": torch.tensor([]),            # torch: ValueError "Tensor lr must be 1-element"
    "two-by-one": torch.full((2, 1), 1e-3),
    "negative": torch.tensor(-0.1),       # torch: ValueError "Invalid learning rate" (it reads the tensor)
}


@pytest.mark.parametrize("case", list(TENSOR_LRS))
@pytest.mark.parametrize("name", [n for n in OPTIMIZERS if n not in NO_TORCH_COUNTERPART])
def test_other_bad_tensor_lrs_raise_what_torch_raises(name, case):
    spec = OPTIMIZERS[name]
    lr = TENSOR_LRS[case]
    with pytest.raises(ValueError) as theirs:
        getattr(torch.optim, spec.torch_counterpart)(make_params(name=name), lr=lr.clone())
    with pytest.raises(type(theirs.value), match=r"\blr\b"):
        spec.cls(make_params(name=name), lr=lr.clone())
