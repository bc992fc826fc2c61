"""Flat mode (``flat=True``) inside trainers: torch.optim's semantics and a model's own checkpoints unchanged.

* A param whose grad is None is not stepped (no momentum, decay or count moves), ``zero_grad()`` sets grads to
  None as torch's does, and a step where every param has a grad is still one pass over the buffers.
* After ``model.zero_grad()`` (what HF Trainer and Lightning call) autograd accumulates into the flat grad
  buffer itself: a hook points each None grad at its alias of the buffer before accumulation.
* Each param is an alias with a storage of its own: safetensors' ``save_model`` and ``load_model`` round-trip,
  ``torch.save(model.state_dict())`` writes each param's bytes, and a pickled optimizer does not write the
  whole buffer once per view.
"""

import copy
import gc
import io
import pickle
import weakref

import pytest
import torch

import fastoptim
from fastoptim.engine import flat
from fastoptim.levels import record_paths

safetensors_torch = pytest.importorskip("safetensors.torch")


class Branchy(torch.nn.Module):
    """A trunk, and a branch that only some steps use (its params then get no grad)."""

    def __init__(self):
        super().__init__()
        self.trunk = torch.nn.Linear(6, 8)
        self.branch = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x, use_branch=True):
        h = self.trunk(x).tanh()
        if use_branch:
            h = self.branch(h).tanh()
        return self.head(h)


def _pair(make_ours, make_ref, seed=0):
    torch.manual_seed(seed)
    ours_model = Branchy()
    ref_model = copy.deepcopy(ours_model)
    return ours_model, make_ours(ours_model.parameters()), ref_model, make_ref(ref_model.parameters())


def _assert_same(ours_model, ours, ref_model, ref, atol=1e-6, rtol=1e-5):
    for (name, a), b in zip(ours_model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")
        assert (a.grad is None) == (b.grad is None), name
        mine, theirs = ours.state.get(a, {}), ref.state.get(b, {})
        assert set(mine) == set(theirs), (name, sorted(mine), sorted(theirs))
        for k, v in theirs.items():
            if k == "step":
                assert float(mine[k]) == float(v), (name, mine[k], v)
            else:
                torch.testing.assert_close(mine[k], v, atol=atol, rtol=rtol, msg=lambda m: f"{name} {k}: {m}")


OPTIMIZERS = {
    "adamw": (lambda ps: fastoptim.AdamW(ps, lr=1e-2, weight_decay=0.1, flat=True),
              lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=False)),
    "sgd_momentum": (lambda ps: fastoptim.SGD(ps, lr=1e-2, momentum=0.9, weight_decay=0.1, flat=True),
                     lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, weight_decay=0.1, foreach=False)),
}


@pytest.mark.parametrize("zero_grad", ["model", "optimizer"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_param_without_a_grad_is_not_stepped_as_in_torch(name, zero_grad):
    """An unused branch: its params get no grad in some steps, and neither momentum, weight decay nor the step
    count moves for them; params, grads and state as torch.optim's after every step."""
    ours_model, ours, ref_model, ref = _pair(*OPTIMIZERS[name])
    x = torch.randn(5, 6)
    for step in range(8):
        use_branch = step % 3 == 0
        for model, opt in ((ours_model, ours), (ref_model, ref)):
            (model if zero_grad == "model" else opt).zero_grad()
            model(x, use_branch).square().mean().backward()
            opt.step()
        assert (ours_model.branch.weight.grad is None) == (not use_branch)
        _assert_same(ours_model, ours, ref_model, ref)


def _differing(ours_model, ref_model, atol=1e-6, rtol=1e-5):
    """The names of the params, and of the grads (``name.grad``), that are not torch.optim's."""
    out = []
    for (name, a), b in zip(ours_model.named_parameters(), ref_model.parameters()):
        if not torch.allclose(a, b, atol=atol, rtol=rtol):
            out.append(name)
        if a.grad is None or b.grad is None:
            same_grad = a.grad is None and b.grad is None
        else:
            same_grad = torch.allclose(a.grad, b.grad, atol=atol, rtol=rtol)
        if not same_grad:
            out.append(f"{name}.grad")
    return out


@pytest.mark.parametrize("dropped", ["head.weight", "branch.bias", "trunk.weight"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_one_grad_set_to_none_starts_again_at_zero_while_the_others_accumulate(name, dropped):
    """No zero_grad between steps, one param's grad set to None by hand, then two backwards: that grad starts
    from zero (its part of the buffer still holds its last grad, which no memset of the whole buffer may clear:
    the other grads are still there and accumulate). ``dropped``: first, amid and last in backward's order."""
    ours_model, ours, ref_model, ref = _pair(*OPTIMIZERS[name])
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(5, 6, generator=g) for _ in range(6)]
    for step in range(3):
        for model, opt in ((ours_model, ours), (ref_model, ref)):
            if step:
                model.get_parameter(dropped).grad = None
            model(xs[2 * step]).square().mean().backward()
            model(xs[2 * step + 1]).square().mean().backward()
            opt.step()
        differing = _differing(ours_model, ref_model)  # (the grads as the step found them)
        assert not differing, f"step {step}: not torch.optim's: {differing}"


def test_zero_grad_sets_grads_to_none_or_zeroes_the_buffer_as_asked():
    model = Branchy()
    model.head.weight.grad = torch.ones_like(model.head.weight)  # a grad before the optimizer is made
    opt = fastoptim.AdamW(model.parameters(), lr=1e-2, flat=True)
    (fb,) = opt._stepper.flat_buckets[0]
    assert [p.grad is None for p in fb.params] == [p is not model.head.weight for p in fb.params]
    i = [p is model.head.weight for p in fb.params].index(True)
    assert model.head.weight.grad.data_ptr() == fb.grad_views[i].data_ptr()
    assert torch.equal(model.head.weight.grad, torch.ones_like(model.head.weight))  # its values kept
    model(torch.randn(3, 6)).sum().backward()
    views = [p.grad for p in fb.params]
    opt.zero_grad(set_to_none=False)  # zeroed in place: the same alias objects on the buffer
    assert all(p.grad is v and not p.grad.any() for p, v in zip(fb.params, views))
    assert not fb.grad_buffer.any()
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_a_step_with_every_grad_is_one_pass_and_a_backward_after_model_zero_grad_writes_the_buffer(monkeypatch):
    """``model.zero_grad()`` then backward: each grad is its alias of the flat grad buffer (autograd accumulated
    there: no grad copied in by the step), and the step is one pass over the buffers."""
    repairs = []  # the repair's per-grad comparison runs only where some grad is not its alias as it lies
    real = flat.same_layout
    monkeypatch.setattr(flat, "same_layout", lambda x, y: repairs.append(1) or real(x, y))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    ref_model = copy.deepcopy(model)
    opt = fastoptim.AdamW(model.parameters(), lr=1e-2, flat=True)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, foreach=False)
    (fb,) = opt._stepper.flat_buckets[0]
    x = torch.randn(4, 8)
    for step in range(4):
        for m, o in ((model, opt), (ref_model, ref)):
            m.zero_grad()
            m(x).square().mean().backward()
        for p, view in zip(fb.params, fb.grad_views):
            assert p.grad is view and p.grad.untyped_storage().data_ptr() == view.data_ptr()
            start = fb.grad_buffer.data_ptr()
            assert start <= p.grad.data_ptr() < start + fb.grad_buffer.nbytes
        with record_paths() as paths:
            opt.step()
        ref.step()
        assert len(paths) == 1 and [b.flat_grad is not None for b in opt._stepper.plans[0].buckets] == [True]
        for a, b in zip(model.parameters(), ref_model.parameters()):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert not repairs  # no grad was ever copied into the buffer: autograd wrote there


def test_the_hooks_keep_no_optimizer_alive_and_do_nothing_once_it_is_gone(monkeypatch):
    calls = []
    real = flat.FlatBucket.point_grad
    monkeypatch.setattr(flat.FlatBucket, "point_grad", lambda self, i: calls.append(i) or real(self, i))
    model = Branchy()
    opt = fastoptim.SGD(model.parameters(), lr=0.1, flat=True)
    model(torch.randn(2, 6)).sum().backward()
    assert len(calls) == 6
    gone = weakref.ref(opt)
    del opt
    gc.collect()
    assert gone() is None
    model.zero_grad()
    model(torch.randn(2, 6)).sum().backward()
    assert len(calls) == 6 and all(p.grad is not None for p in model.parameters())


def test_torch_autograd_grad_leaves_grads_as_they_are():
    """``torch.autograd.grad`` does not accumulate into ``.grad``: the grads stay None (a tensor hook would run
    there and point them at the buffer, and the next step would step zeros)."""
    ours_model, ours, ref_model, ref = _pair(*OPTIMIZERS["sgd_momentum"])
    x = torch.randn(5, 6)
    for model, opt in ((ours_model, ours), (ref_model, ref)):
        torch.autograd.grad(model(x).sum(), list(model.parameters()))
        assert all(p.grad is None for p in model.parameters())
        model.head.weight.grad = torch.ones_like(model.head.weight)
        opt.step()
    _assert_same(ours_model, ours, ref_model, ref)


def test_a_hook_never_points_a_grad_at_a_buffer_the_param_left():
    """``p.data = t`` between steps: the param is no longer the buffer's until the next step copies it in, so
    its grad is autograd's own; the step then takes both in, as torch.optim steps the new data."""
    ours_model, ours, ref_model, ref = _pair(*OPTIMIZERS["adamw"])
    (fb,) = ours._stepper.flat_buckets[0]
    x = torch.randn(5, 6)
    for step in range(3):
        for model, opt in ((ours_model, ours), (ref_model, ref)):
            model.zero_grad()
            if step == 1:
                model.trunk.weight.data = torch.full((8, 6), 0.5)
            model(x).square().mean().backward()
            if step == 1 and model is ours_model:
                g = model.trunk.weight.grad
                start = fb.grad_buffer.data_ptr()
                assert not start <= g.data_ptr() < start + fb.grad_buffer.nbytes
            opt.step()
        _assert_same(ours_model, ours, ref_model, ref)



@pytest.mark.parametrize("moved", ["model.share_memory()", "grad.share_memory_()"])
def test_a_grad_whose_memory_moved_after_the_step_starts_the_next_backward_at_zero(moved):
    """Grads moved to shared memory after a step (``model.share_memory()`` moves params and grads), then
    ``model.zero_grad()`` and a backward: the hook must not hand a moved alias (still holding the last grads,
    out of the buffer's memset) back as the grad; it hands out a new alias of the zeroed buffer."""
    ours_model, ours, ref_model, ref = _pair(*OPTIMIZERS["sgd_momentum"])
    x = torch.randn(5, 6)
    for step in range(3):
        for model, opt in ((ours_model, ours), (ref_model, ref)):
            model.zero_grad()
            model(x).square().mean().backward()
            opt.step()
            if step == 0 and model is ours_model:
                if moved == "model.share_memory()":
                    model.share_memory()
                else:
                    for p in model.parameters():
                        p.grad.share_memory_()
        _assert_same(ours_model, ours, ref_model, ref)

def _train(model, opt, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(5, 6, generator=g)
        model.zero_grad()
        model(x).square().mean().backward()
        opt.step()


def test_safetensors_save_model_and_load_model_round_trip(tmp_path):
    """Each param's storage is its own (an alias of the buffer): save_model writes every tensor, load_model
    writes through to the buffer, and training goes on exactly as without flat mode."""
    torch.manual_seed(0)
    model = Branchy()
    ref_model = copy.deepcopy(model)
    opt = fastoptim.AdamW(model.parameters(), lr=1e-2, flat=True)
    ref = fastoptim.AdamW(ref_model.parameters(), lr=1e-2)
    _train(model, opt, 3, seed=1)
    _train(ref_model, ref, 3, seed=1)
    path = tmp_path / "model.safetensors"
    safetensors_torch.save_model(model, str(path))
    saved = safetensors_torch.load_file(str(path))
    assert set(saved) == set(model.state_dict())
    for name, value in model.state_dict().items():
        assert torch.equal(saved[name], value), name
    # loaded into the flat model (other values in first): the buffer holds what was saved
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(3.0)
    missing, unexpected = safetensors_torch.load_model(model, str(path))
    assert not missing and not unexpected
    (fb,) = opt._stepper.flat_buckets[0]
    assert all(p.untyped_storage().data_ptr() == v.data_ptr() for p, v in zip(fb.params, fb.param_views))
    _train(model, opt, 3, seed=2)
    _train(ref_model, ref, 3, seed=2)
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)


def test_torch_save_of_the_state_dict_writes_each_params_own_bytes():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(8)])
    plain = io.BytesIO()
    torch.save(model.state_dict(), plain)
    fastoptim.AdamW(model.parameters(), lr=1e-2, flat=True)
    one = io.BytesIO()
    torch.save(model.state_dict()["3.weight"], one)
    assert len(one.getvalue()) < 32 * 32 * 4 + 2000  # its bytes, not the whole buffer's
    whole = io.BytesIO()
    torch.save(model.state_dict(), whole)
    assert len(whole.getvalue()) < 1.1 * len(plain.getvalue())
    whole.seek(0)
    loaded = torch.load(whole)
    for name, value in model.state_dict().items():
        assert torch.equal(loaded[name], value)


@pytest.mark.parametrize("state_bits", [32, 8])
def test_a_pickled_or_deep_copied_flat_optimizer_is_its_state_not_a_buffer_per_view(state_bits):
    """pickle writes each view's whole storage: with aliases (and 8-bit states' codes and scales copied out of
    their pools) a flat optimizer pickles as big as a plain one (within 10 %), and an unpickled or deep-copied
    one steps on as the original does."""
    def build(flat_mode):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(10)])
        opt = fastoptim.AdamW(model.parameters(), lr=1e-2, flat=flat_mode, state_bits=state_bits,
                              min_quant_size=256)
        _train_seq(model, opt, 2, seed=1)
        return model, opt

    model, opt = build(True)
    _, plain = build(False)
    flat_size, plain_size = len(pickle.dumps(opt)), len(pickle.dumps(plain))
    assert flat_size < 1.1 * plain_size, (flat_size, plain_size)
    reference = copy.deepcopy(model)  # (its params: plain tensors of their own)
    ref_opt = fastoptim.AdamW(reference.parameters(), lr=1e-2, state_bits=state_bits, min_quant_size=256)
    ref_opt.load_state_dict(opt.state_dict())
    _train_seq(reference, ref_opt, 3, seed=2)
    for twin, copied in (pickle.loads(pickle.dumps((model, opt))), copy.deepcopy((model, opt))):
        _train_seq(twin, copied, 3, seed=2)
        for a, b in zip(twin.parameters(), reference.parameters()):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
        (fb,) = copied._stepper.flat_buckets[0]
        with record_paths() as paths:
            _train_seq(twin, copied, 1, seed=3)
        # one pass: 32-bit over the buffers; 8-bit the quantized head in the CPU kernel and the plain tail in torch's
        assert len(paths) == (1 if state_bits == 32 else 2), paths
        shape = [b.flat_grad is not None for b in copied._stepper.plans[0].buckets]
        assert shape == [b.flat_grad is not None for b in opt._stepper.plans[0].buckets] and shape[-1]  # as the original
        assert all(p.grad is v for p, v in zip(fb.params, fb.grad_views))  # autograd wrote the copy's buffer
    _train_seq(model, opt, 3, seed=2)  # the original steps on, on its own buffers
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def _train_seq(model, opt, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model.zero_grad()
        model(torch.randn(4, 16, generator=g)).square().mean().backward()
        opt.step()


def test_accelerate_save_state_writes_every_param(tmp_path):
    """accelerate's ``save_state`` writes the model with safetensors; with flat views of one storage it kept one
    tensor of eight and said nothing."""
    accelerate = pytest.importorskip("accelerate")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    opt = fastoptim.AdamW(model.parameters(), lr=1e-2, flat=True)
    acc = accelerate.Accelerator(cpu=True)
    model, opt = acc.prepare(model, opt)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    acc.save_state(str(tmp_path))
    saved = safetensors_torch.load_file(str(tmp_path / "model.safetensors"))
    assert set(saved) == set(model.state_dict())
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())


def test_the_clip_norm_counts_only_the_grads_there_are():
    """``max_grad_norm`` with some grads None: the part of the grad buffer of a param whose grad was set to None
    still holds its old values, and must not count (it did when the norm was taken over the whole buffer)."""
    torch.manual_seed(0)
    ours_p = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(4)]
    ref_p = [torch.nn.Parameter(p.detach().clone()) for p in ours_p]
    ours = fastoptim.AdamW(ours_p, lr=0.1, flat=True, max_grad_norm=0.5)
    ref = fastoptim.AdamW(ref_p, lr=0.1, max_grad_norm=0.5)
    for step in range(5):
        for i, (a, b) in enumerate(zip(ours_p, ref_p)):
            if (i + step) % 3 == 0:
                a.grad = b.grad = None
            else:
                g = torch.randn(5, 3) * 3
                a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
        assert torch.equal(ours.last_grad_norm, ref.last_grad_norm)
        for a, b in zip(ours_p, ref_p):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
