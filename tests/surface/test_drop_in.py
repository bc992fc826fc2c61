"""Small drop-in details of torch.optim: complex params refused at the step as torch refuses them, a
resumed, deep-copied or unpickled optimizer whose state_dict has the keys of the one saved, and grads that
are lazily negated views read by their values."""

import copy
import pickle

import pytest
import torch

from conftest import NAME_FLAT, make_params, set_grads, two_groups
from fastoptim.levels import LEVELS
from fastoptim.reference import ReferenceMuon
from fastoptim.registry import OPTIMIZERS

# --- complex params: torch.optim.Adafactor and Muon take them and refuse them at the step ---------------------

REFUSE_COMPLEX = ["adafactor", "muon"]


def _complex_case(name, complex_grad=True):
    """Two groups: real matrices with grads, then a complex matrix (with a grad, or none)."""
    g = torch.Generator().manual_seed(0)
    real = [torch.nn.Parameter(torch.randn(4, 3, generator=g)), torch.nn.Parameter(torch.randn(3, 5, generator=g))]
    cplx = torch.nn.Parameter(torch.randn(2, 3, dtype=torch.complex64, generator=g))
    for p in real:
        p.grad = torch.randn(p.shape, generator=g)
    cplx.grad = torch.randn(cplx.shape, dtype=torch.complex64, generator=g) if complex_grad else None
    return real, cplx


@pytest.mark.sample("name", "level")
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name", REFUSE_COMPLEX)
def test_complex_params_are_refused_at_the_step_as_torch_refuses_them(name, level):
    spec = OPTIMIZERS[name]
    theirs_real, theirs_cplx = _complex_case(name)
    theirs = getattr(torch.optim, spec.torch_counterpart)([{"params": theirs_real}, {"params": [theirs_cplx]}])
    with pytest.raises(RuntimeError) as expected:
        theirs.step()
    assert "does not support complex parameters" in str(expected.value)

    real, cplx = _complex_case(name)
    before = [p.detach().clone() for p in (*real, cplx)]
    ours = spec.cls([{"params": real}, {"params": [cplx]}], impl=level)  # taken, as torch takes it
    with pytest.raises(type(expected.value)) as raised:
        ours.step()
    assert str(raised.value) == str(expected.value)
    # nothing changed, the first group included (torch would have stepped it already)
    for p, b in zip((*real, cplx), before):
        assert torch.equal(p, b)
    assert all(not s for s in ours.state.values())
    cplx.grad = None  # and the optimizer is still usable: without the complex grad it steps
    ours.step()
    assert not torch.equal(real[0], before[0]) and torch.equal(cplx, before[2])


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name", REFUSE_COMPLEX)
def test_a_complex_param_without_a_grad_is_not_refused(name, level):
    """torch checks only params that have a grad; the real ones step as they would without the complex one."""
    spec = OPTIMIZERS[name]
    real, cplx = _complex_case(name, complex_grad=False)
    ref_real, _ = _complex_case(name, complex_grad=False)
    fp32 = {"ns_dtype": "float32"} if name == "muon" else {}  # (the oracle's Newton-Schulz products in fp32)
    ours = spec.cls([{"params": real}, {"params": [cplx]}], impl=level, **fp32)
    ref = (torch.optim.Adafactor(ref_real, foreach=False) if name == "adafactor" else ReferenceMuon(ref_real, **fp32))
    ours.step()
    ref.step()
    for a, b in zip(real, ref_real):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert cplx not in ours.state or not ours.state[cplx]


def test_muon_adamw_groups_take_complex_params():
    """The AdamW part of the Muon recipe steps complex params, as torch.optim.AdamW does."""
    g = torch.Generator().manual_seed(1)
    p = torch.nn.Parameter(torch.randn(3, dtype=torch.complex64, generator=g))
    q = torch.nn.Parameter(p.detach().clone())
    ours = OPTIMIZERS["muon"].cls([{"params": [p], "use_muon": False, "lr": 1e-2}])
    theirs = torch.optim.AdamW([q], lr=1e-2, betas=ours.param_groups[0]["betas"], eps=ours.param_groups[0]["eps"],
                               weight_decay=ours.param_groups[0]["weight_decay"], foreach=False)
    for _ in range(2):
        p.grad = torch.randn(3, dtype=torch.complex64, generator=g)
        q.grad = p.grad.clone()
        ours.step()
        theirs.step()
    torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)


# --- a resumed optimizer's state_dict has the keys of the one saved ------------------------------------------

def _keys(opt):
    sd = opt.state_dict()
    return (sorted(sd), [sorted(g) for g in sd["param_groups"]], {i: sorted(s) for i, s in sd["state"].items()},
            sorted(opt.defaults))


def _stepped(name, flat):
    params = make_params(name=name)
    opt = OPTIMIZERS[name].cls(two_groups(params, {}), flat=flat)
    for step in (1, 2):
        set_grads(step, [params])
        opt.step()
    return opt, params


@pytest.mark.parametrize("name,flat", NAME_FLAT)
def test_load_state_dict_deepcopy_and_pickle_keep_the_keys(name, flat):
    """torch's Optimizer.__setstate__ adds ``differentiable`` to ``defaults``; no fastoptim optimizer takes it, so
    it must not reach the groups (a resumed run's checkpoint would differ from the straight run's)."""
    opt, _ = _stepped(name, flat)
    saved = _keys(opt)
    assert "differentiable" not in saved[1][0]

    copied = copy.deepcopy(opt)
    assert _keys(copied) == saved
    unpickled = pickle.loads(pickle.dumps(opt))
    assert _keys(unpickled) == saved
    opt.load_state_dict(opt.state_dict())
    assert _keys(opt) == saved
    # and a fresh optimizer that loads the checkpoint
    fresh, _ = _stepped(name, flat)
    fresh.load_state_dict(copied.state_dict())
    assert _keys(fresh) == saved


# --- grads that are lazily negated views (``z.conj().imag`` makes one): their values, not their memory ----------

@pytest.mark.parametrize("bits", (32, 8, 4))
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_a_lazily_negated_grad_steps_with_its_values_as_in_torch(name, level, bits):
    """torch.optim's loop and foreach steps read such a grad by its values (its memory holds their negation).
    Every level takes it the same way, the CPU kernel for 8/4-bit state included (it read the memory), and the
    user's grad stays the view it was."""
    from fastoptim.levels import record_paths

    spec = OPTIMIZERS[name]
    opts = dict(lr=0.1, momentum=0.9) if name == "sgd" else dict(lr=0.1)
    g = torch.Generator().manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(64, 96, generator=g)), torch.nn.Parameter(torch.randn(40, generator=g))]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt = spec.cls(ours, impl=level, state_bits=bits, min_quant_size=0, **opts)
    ref = spec.cls(theirs, impl="loop", state_bits=bits, min_quant_size=0, **opts)
    for step in range(3):
        for a, b in zip(ours, theirs):
            values = torch.randn(a.shape, generator=g)
            a.grad = (-values)._neg_view() if step != 1 else values.clone()  # (plain in between: cached tables)
            b.grad = values
        with record_paths() as paths:
            opt.step()
        ref.step()
        if bits != 32 and level == "fused":
            assert "cpu_kernel" in paths, paths
        assert ours[0].grad.is_neg() == (step != 1)
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
