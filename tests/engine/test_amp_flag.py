"""``_step_supports_amp_scaling``: claimed only where a kernel reads GradScaler's found_inf itself.

Where it is claimed, GradScaler hands the step grad_scale/found_inf and never learns whether the step was taken:
Lightning then refuses ``gradient_clip_val`` and accelerate reports a skipped step as taken (and advances the LR
schedule). torch.optim claims it only for ``fused=True``; on the CPU no fastoptim kernel gains anything by it.
"""

import pytest
import torch

import fastoptim
from fastoptim.levels import IMPLS, record_paths
from fastoptim.reference import reference_class, reference_kwargs
from fastoptim.registry import OPTIMIZERS

from conftest import FLAT, assert_params_close, clone_params, shape_for


def _params(name, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape_for(name, s), generator=g)) for s in [(4, 3), (3,)]]


def _assert_state_equal(ours, ref):
    """torch.optim's state_dict entries (step counts included), as each optimizer writes them."""
    ours_sd, ref_sd = ours.state_dict()["state"], ref.state_dict()["state"]
    assert set(ours_sd) == set(ref_sd)
    for i in ref_sd:
        for k, v in ref_sd[i].items():
            torch.testing.assert_close(ours_sd[i][k].float(), v.float(), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_flag_is_false_on_the_cpu(monkeypatch, name, impl):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    opt = OPTIMIZERS[name].cls(_params(name), impl=impl)
    assert opt._step_supports_amp_scaling is False
    flat = OPTIMIZERS[name].cls(_params(name), impl=impl, flat=name in FLAT, state_bits=8, min_quant_size=1)
    assert flat._step_supports_amp_scaling is False


def test_the_flag_follows_the_kernels_that_read_found_inf(monkeypatch):
    """Under Triton's interpreter the fused kernels run on CPU tensors as on CUDA and read found_inf themselves:
    the flag holds there, and only there (not for other levels, per-tensor stages, or stochastic rounding)."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert fastoptim.AdamW(_params("adamw"), impl="fused")._step_supports_amp_scaling is True
    assert fastoptim.AdamW(_params("adamw"), impl="auto", flat=True)._step_supports_amp_scaling is True
    assert fastoptim.AdamW(_params("adamw"), impl="loop")._step_supports_amp_scaling is False
    assert fastoptim.AdamW(_params("adamw"), impl="compiled")._step_supports_amp_scaling is False
    assert fastoptim.Muon(_params("muon"), impl="fused")._step_supports_amp_scaling is False
    assert fastoptim.Adafactor(_params("adafactor"), impl="fused")._step_supports_amp_scaling is False
    bf16 = [torch.nn.Parameter(torch.randn(4, 3, dtype=torch.bfloat16))]
    assert fastoptim.AdamW(bf16, impl="fused", rounding="stochastic")._step_supports_amp_scaling is False


def test_the_flag_reads_each_groups_own_rounding(monkeypatch):
    """Stochastic rounding reads found_inf on the host: a group's own ``rounding`` decides, not the optimizer's
    default (which only the groups that set none take)."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")

    def bf16():
        return [torch.nn.Parameter(torch.randn(4, 3, dtype=torch.bfloat16))]

    one_group_stochastic = fastoptim.AdamW([{"params": bf16()}, {"params": bf16(), "rounding": "stochastic"}],
                                           impl="fused")
    assert one_group_stochastic._step_supports_amp_scaling is False, "a group rounds stochastically"
    no_group_stochastic = fastoptim.AdamW([{"params": bf16(), "rounding": "nearest"},
                                           {"params": bf16(), "rounding": "kahan"}],
                                          impl="fused", rounding="stochastic")
    assert no_group_stochastic._step_supports_amp_scaling is True, "no group rounds stochastically"
    no_group_stochastic.param_groups[1]["rounding"] = "stochastic"  # (asked at every GradScaler step)
    assert no_group_stochastic._step_supports_amp_scaling is False


def _scaler():
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    scaler.scale(torch.ones(()))  # (its scale is made at the first scale())
    return scaler


def _scaled_steps(opt, params, scaler, infs, accelerated=None, sched=None, clip=None, seed=1):
    """Steps with grads scaled as GradScaler scales them, an inf grad where ``infs`` says; returns the LR after
    each step. ``accelerated``: step through accelerate's AcceleratedOptimizer and AcceleratedScheduler."""
    g = torch.Generator().manual_seed(seed)
    lrs = []
    for inf in infs:
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) * scaler.get_scale()
        if inf:
            params[0].grad.view(-1)[0] = float("inf")
        if clip is not None:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(params, clip)
        if accelerated is not None:
            accelerated[0].step()
            accelerated[1].step()
        else:
            scaler.step(opt)
            scaler.update()
            if sched is not None:
                sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    return lrs


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_accelerate_sees_a_skipped_step_and_holds_the_lr_as_for_torch_optim(name):
    """accelerate decides ``step_was_skipped`` by whether the optimizer's ``step`` was called. accelerate 1.15 gives
    a CPU run under mixed_precision="fp16" no GradScaler, so its AcceleratedOptimizer and AcceleratedScheduler are
    built here around a CPU GradScaler (the same code paths a CUDA run takes)."""
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.scheduler import AcceleratedScheduler

    Accelerator(cpu=True)  # (sets up the state the wrappers read)
    spec = OPTIMIZERS[name]
    opts = spec.option_sets[0]
    ours_p = _params(name)
    ref_p = clone_params(ours_p)
    infs = [False, True, False, True, False]
    runs = []
    for params, make in ((ours_p, lambda ps: spec.cls(ps, **opts)),
                         (ref_p, lambda ps: reference_class(spec)(ps, **opts, **reference_kwargs(spec)))):
        opt = make(params)
        scaler = _scaler()
        accelerated = AcceleratedOptimizer(opt, device_placement=False, scaler=scaler)
        sched = AcceleratedScheduler(torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5), accelerated)
        skipped = []
        lrs = []
        for inf in infs:
            lrs += _scaled_steps(opt, params, scaler, [inf], (accelerated, sched), seed=len(lrs))
            skipped.append(accelerated.step_was_skipped)
        runs.append((opt, skipped, lrs))
    (ours, ours_skipped, ours_lrs), (ref, ref_skipped, ref_lrs) = runs
    assert ref_skipped == infs
    assert ours_skipped == ref_skipped
    assert ours_lrs == ref_lrs
    assert_params_close(ours_p, ref_p)
    _assert_state_equal(ours, ref)


@pytest.mark.parametrize("impl,flat,bits", [("auto", False, 32), ("loop", False, 32), ("foreach", True, 32),
                                            ("compiled", False, 32), ("fused", True, 8), ("interpret", False, 32),
                                            ("interpret", True, 32)])
def test_unscale_clip_then_step_matches_torch_optim(monkeypatch, impl, flat, bits):
    """``scaler.unscale_(opt)``, clipping, then ``scaler.step(opt)``: GradScaler unscales once and the step neither
    unscales again nor takes a skipped step. ``interpret``: the fused Triton kernels under the interpreter, where
    the flag holds and GradScaler hands the step found_inf (and no grad_scale, the grads being unscaled)."""
    if impl == "interpret":
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        impl = "fused"
    ours_p = [torch.nn.Parameter(torch.randn(64, 80)), torch.nn.Parameter(torch.randn(80))]
    ref_p = clone_params(ours_p)
    ours = fastoptim.AdamW(ours_p, lr=1e-2, impl=impl, flat=flat, state_bits=bits, min_quant_size=1)
    ref = torch.optim.AdamW(ref_p, lr=1e-2, foreach=False)
    infs = [False, True, False, False]
    with record_paths() as paths:
        _scaled_steps(ours, ours_p, _scaler(), infs, clip=0.5)
    _scaled_steps(ref, ref_p, _scaler(), infs, clip=0.5)
    if flat is False and bits == 32 and impl == "fused":
        assert set(paths) == {"triton"}
    atol = 1e-6 if bits == 32 else 2e-2  # 8-bit moments: within their quantization of the 32-bit run
    for a, b in zip(ours_p, ref_p):
        torch.testing.assert_close(a, b, atol=atol, rtol=1e-5)
    assert ours.state[ours_p[0]]["step"] == ref.state[ref_p[0]]["step"] == 3


def test_lightning_clips_under_bf16_mixed_with_a_fastoptim_optimizer():
    """Lightning refuses ``gradient_clip_val`` for an optimizer that claims to unscale inside its step; a fastoptim
    AdamW on the CPU trains as torch.optim.AdamW does, clipped."""
    pl = pytest.importorskip("lightning.pytorch")

    class Tiny(pl.LightningModule):
        def __init__(self, make_opt):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
            self.make_opt = make_opt

        def training_step(self, batch, _):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x).float(), y) * 100.0  # big grads: the clip bites

        def configure_optimizers(self):
            return self.make_opt(self.parameters())

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(16, 6, generator=g), torch.randn(16, 1, generator=g))
    results = []
    for make_opt in (lambda ps: fastoptim.AdamW(ps, lr=1e-2), lambda ps: torch.optim.AdamW(ps, lr=1e-2)):
        model = Tiny(make_opt)
        trainer = pl.Trainer(accelerator="cpu", devices=1, precision="bf16-mixed", gradient_clip_val=1.0,
                             max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False)
        trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=4))
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("flat", [False, True])
def test_grad_scale_and_found_inf_set_by_hand_still_work(impl, flat):
    """GradScaler no longer hands them over on the CPU, but the step still honours them as attributes (as
    GradScaler sets them where the flag holds): found_inf set skips the step, grad_scale unscales the grads."""
    ours_p = [torch.nn.Parameter(torch.randn(5, 4)), torch.nn.Parameter(torch.randn(4))]
    ref_p = clone_params(ours_p)
    ours = fastoptim.AdamW(ours_p, lr=1e-2, impl=impl, flat=flat)
    ref = torch.optim.AdamW(ref_p, lr=1e-2, foreach=False)
    g = torch.Generator().manual_seed(0)
    for inf in (False, True, False):
        grads = [torch.randn(p.shape, generator=g) for p in ref_p]
        for p, grad in zip(ours_p, grads):
            p.grad = grad * 64.0
        ours.grad_scale, ours.found_inf = torch.tensor(64.0), torch.tensor(float(inf))
        ours.step()
        del ours.grad_scale, ours.found_inf
        if not inf:
            for p, grad in zip(ref_p, grads):
                p.grad = grad
            ref.step()
    assert_params_close(ours_p, ref_p)
    _assert_state_equal(ours, ref)
