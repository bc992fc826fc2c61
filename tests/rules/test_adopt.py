"""ADOPT (``fastoptim.rules.adopt``) against the authors' own step, and the part of its surface that is its own:
``clip_lambda``, a function, kept out of checkpoints.

``AuthorsADOPT`` below is the reference: the single-tensor step of the authors' ``adopt.py``
(github.com/iShohei220/adopt, src/adopt/adopt.py at commit 6468572, ``_single_tensor_adopt``), its operations in
their order (``lerp_``, ``addcmul_``, ``clamp_``), in fp32, one tensor at a time, with ``clip_lambda`` kept on the
optimizer as theirs keeps it; only their capturable, differentiable and complex branches are left out. The
registry's oracle (``fastoptim.rules.adopt.ReferenceADOPT``, fp64) runs the parity matrix of
tests/surface/test_parity.py.

On the CPU the fused level steps fp32 state of these sizes on the foreach path (the compiled path takes tensors of
16K elements and more); its C++ kernel takes 16/8/4-bit state: ``test_8bit_state_...`` runs it here, and
tests/paths/test_cpu_kernels.py holds it to the rule's IEEE math byte for byte.
"""

import copy
import io
import pickle

import pytest
import torch

import fastoptim
from conftest import assert_state_close
from fastoptim import storage
from fastoptim.levels import LEVELS, record_paths

SHAPES = [(16, 24), (40,), (1,)]
PATH = {"loop": "loop", "foreach": "foreach", "fused": "foreach", "compiled": "compiled"}
STEPS = 20
OPTIONS = [
    dict(lr=1e-2),  # the authors' clip, t ** 0.25
    dict(lr=1e-2, weight_decay=0.1),
    dict(lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1, decouple=True, maximize=True),
    dict(lr=1e-2, clip_lambda=None),
    dict(lr=1e-2, clip_lambda=None, weight_decay=0.1, decouple=True, eps=1e-3),
]


class AuthorsADOPT(torch.optim.Optimizer):
    """The authors' ``_single_tensor_adopt``, transcribed (see the module's docstring)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.9999), eps=1e-6, clip_lambda=lambda step: step ** 0.25,
                 weight_decay=0.0, decouple=False, maximize=False):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, decouple=decouple,
                                      maximize=maximize))
        self.clip_lambda = clip_lambda

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, weight_decay, eps, decouple = group["lr"], group["weight_decay"], group["eps"], group["decouple"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if len(state) == 0:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                grad = param.grad if not group["maximize"] else -param.grad
                exp_avg, exp_avg_sq, step_t = state["exp_avg"], state["exp_avg_sq"], state["step"]
                step = step_t.item()
                if weight_decay != 0 and not decouple:
                    grad = grad.add(param, alpha=weight_decay)
                if step == 0:
                    exp_avg_sq.addcmul_(grad, grad.conj())
                    step_t += 1
                    continue
                if weight_decay != 0 and decouple:
                    param.add_(param, alpha=-lr * weight_decay)
                denom = torch.clamp(exp_avg_sq.sqrt(), eps)
                normed_grad = grad.div(denom)
                if self.clip_lambda is not None:
                    clip = self.clip_lambda(step)
                    normed_grad.clamp_(-clip, clip)
                exp_avg.lerp_(normed_grad, 1 - beta1)
                param.add_(exp_avg, alpha=-lr)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad.conj(), value=1 - beta2)
                step_t += 1


def _params(seed, shapes=SHAPES):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes], g


def _clone(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def _grads(g, *param_lists, scale=3.0):
    """One grad per param, ``scale`` times a normal draw (ADOPT normalises: a unit scale would hide a missing
    factor), the same on every list."""
    for ps in zip(*param_lists):
        grad = torch.randn(ps[0].shape, generator=g) * scale
        for p in ps:
            p.grad = grad.clone()


@pytest.mark.sample("index", "level")
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("index", range(len(OPTIONS)))
def test_matches_the_authors_step_every_step(index, level):
    opts = OPTIONS[index]
    ours_p, g = _params(index)
    theirs_p = _clone(ours_p)
    ours = fastoptim.ADOPT(ours_p, impl=level, **opts)
    theirs = AuthorsADOPT(theirs_p, **opts)
    worst = 0.0
    for step in range(1, STEPS + 1):
        _grads(g, ours_p, theirs_p)
        before = [p.detach().clone() for p in ours_p]
        with record_paths() as paths:
            ours.step()
        theirs.step()
        assert PATH[level] in paths, (level, paths)
        for a, b, was in zip(ours_p, theirs_p, before):
            mine, authors = ours.state[a], theirs.state[b]
            assert mine["step"] == authors["step"].item() == step
            if step == 1:  # the second moment only: the param and the first moment exactly as they were
                assert torch.equal(a.detach(), was) and not mine["exp_avg"].any()
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
            worst = max(worst, (a - b).abs().max().item())
            for name in ("exp_avg", "exp_avg_sq"):
                assert_state_close(mine[name], authors[name], msg=name)
    print(f"ADOPT vs the authors' step, options {index}, {level}: max |param difference| {worst:.3g}")


def test_clip_lambda_gets_the_steps_taken_before_this_one():
    """As the authors call it (their state's step before its increment): 1 on the second step; never on the
    first, which clips nothing."""
    seen = []
    (p,), g = _params(0, [(5,)])
    opt = fastoptim.ADOPT([p], clip_lambda=lambda step: seen.append(step) or 1.0, impl="loop")
    for _ in range(4):
        _grads(g, [p])
        opt.step()
    assert seen == [1, 2, 3]
    assert fastoptim.ADOPT([p]).defaults["clip_lambda"](16) == 2.0  # the authors' default, step ** 0.25


def _saved(opt):
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_a_users_clip_lambda_stays_out_of_the_checkpoint_and_the_loader_keeps_its_own():
    def clip(step):  # a user's function: pickled by name it would load only where its module imports
        return 0.5 * step ** 0.5
    params, g = _params(1)
    opt = fastoptim.ADOPT(params, lr=1e-2, clip_lambda=clip, weight_decay=0.1)
    for _ in range(3):
        _grads(g, params)
        opt.step()
    with pytest.raises((pickle.PicklingError, AttributeError)):  # what the groups hold, saved as they are
        torch.save(torch.optim.Optimizer.state_dict(opt), io.BytesIO())
    saved = _saved(opt)
    assert all("clip_lambda" not in group for group in saved["param_groups"])
    twin_p = _clone(params)
    twin = fastoptim.ADOPT(twin_p, lr=1e-3, clip_lambda=clip)
    twin.load_state_dict(saved)
    assert twin.param_groups[0]["clip_lambda"] is clip and twin.param_groups[0]["weight_decay"] == 0.1
    for _ in range(5):
        _grads(g, params, twin_p)
        opt.step()
        twin.step()
        for a, b in zip(params, twin_p):
            assert torch.equal(a, b)
            assert all(torch.equal(opt.state[a][k], twin.state[b][k]) for k in ("exp_avg", "exp_avg_sq"))
    unclipped = fastoptim.ADOPT(_clone(params), clip_lambda=None)
    unclipped.load_state_dict(_saved(opt))
    assert unclipped.param_groups[0]["clip_lambda"] is None  # the loading optimizer's own


def test_deepcopy_and_pickle_take_a_lambda_as_torch_optim_does():
    """deepcopy keeps the function (copy shares functions); pickle refuses a lambda with the error torch.optim's
    own optimizers give; the default clip is a named function, so a default ADOPT pickles."""
    clip = lambda step: step ** 0.5  # noqa: E731
    params, g = _params(2)
    opt = fastoptim.ADOPT(params, lr=1e-2, clip_lambda=clip)
    torch_opt = torch.optim.SGD(_clone(params), lr=0.1)
    torch_opt.param_groups[0]["clip_lambda"] = clip
    with pytest.raises(Exception) as theirs:
        pickle.dumps(torch_opt)
    with pytest.raises(type(theirs.value)):
        pickle.dumps(opt)
    default = fastoptim.ADOPT(_clone(params), lr=1e-2)
    for o, ps in ((opt, params), (default, default.param_groups[0]["params"])):
        for _ in range(2):
            _grads(g, ps)
            o.step()
        twin = pickle.loads(pickle.dumps(o)) if o is default else copy.deepcopy(o)
        assert twin.param_groups[0]["clip_lambda"] is o.param_groups[0]["clip_lambda"]
        twin_p = twin.param_groups[0]["params"]
        for _ in range(3):
            _grads(g, ps, twin_p)
            o.step()
            twin.step()
            assert all(torch.equal(a, b) for a, b in zip(ps, twin_p))


def test_8bit_state_steps_close_to_32bit():
    """The fused level's C++ kernel on 8-bit state (the matrix; the vector keeps 32-bit state): the first step
    moves nothing and stores v = g^2, and 20 steps stay close to the 32-bit run."""
    ours_p, g = _params(3, [(64, 96), (40,)])
    full_p, start = _clone(ours_p), _clone(ours_p)
    low = fastoptim.ADOPT(ours_p, lr=1e-2, weight_decay=0.1, state_bits=8)
    full = fastoptim.ADOPT(full_p, lr=1e-2, weight_decay=0.1)
    for step in range(1, STEPS + 1):
        _grads(g, ours_p, full_p)
        with record_paths() as paths:
            low.step()
        full.step()
        assert "cpu_kernel" in paths, paths
        if step == 1:
            state = low.state[ours_p[0]]
            assert all(isinstance(state[k], storage.QuantizedState) for k in ("exp_avg", "exp_avg_sq"))
            assert torch.equal(ours_p[0].detach(), start[0].detach())
            assert not storage.torch_value(state["exp_avg"], ours_p[0]).any()
            v, exact = storage.torch_value(state["exp_avg_sq"], ours_p[0]), full.state[full_p[0]]["exp_avg_sq"]
            assert (v - exact).abs().max() < 0.01 * exact.max()  # (measured: 0.3 % of the largest)
    moved = (full_p[0] - start[0]).norm()
    apart = (ours_p[0] - full_p[0]).norm()
    assert 0 < apart < 0.05 * moved, (apart.item(), moved.item())  # (measured: 1.6 %)
    torch.testing.assert_close(ours_p[1], full_p[1], atol=1e-6, rtol=1e-5)  # 32-bit state: the same math


@pytest.mark.parametrize("kwargs,word", [(dict(clip_lambda=1.0), "clip_lambda"), (dict(decouple=1), "decouple"),
                                         (dict(betas=(0.9, 1.0)), "beta2"), (dict(eps=-1.0), "eps")])
def test_bad_hyperparameter_is_named(kwargs, word):
    with pytest.raises((ValueError, TypeError), match=word):
        fastoptim.ADOPT([torch.nn.Parameter(torch.ones(3))], **kwargs)
