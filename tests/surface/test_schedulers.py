"""Every torch.optim.lr_scheduler drives a fastoptim optimizer exactly as it drives torch's."""

import pytest
from torch.optim import lr_scheduler as S

from conftest import assert_params_close, clone_params, make_params, set_grads
from fastoptim.registry import OPTIMIZERS
from fastoptim.reference import reference_class, reference_kwargs

SCHEDULERS = {
    "LambdaLR": lambda o: S.LambdaLR(o, lambda e: 0.9 ** e),
    "MultiplicativeLR": lambda o: S.MultiplicativeLR(o, lambda e: 0.95),
    "StepLR": lambda o: S.StepLR(o, step_size=3, gamma=0.5),
    "MultiStepLR": lambda o: S.MultiStepLR(o, milestones=[2, 5], gamma=0.3),
    "ConstantLR": lambda o: S.ConstantLR(o, factor=0.5, total_iters=4),
    "LinearLR": lambda o: S.LinearLR(o, start_factor=0.2, total_iters=5),
    "ExponentialLR": lambda o: S.ExponentialLR(o, gamma=0.9),
    "PolynomialLR": lambda o: S.PolynomialLR(o, total_iters=8, power=2.0),
    "CosineAnnealingLR": lambda o: S.CosineAnnealingLR(o, T_max=10, eta_min=1e-4),
    "CosineAnnealingWarmRestarts": lambda o: S.CosineAnnealingWarmRestarts(o, T_0=4, T_mult=2),
    "SequentialLR": lambda o: S.SequentialLR(o, [S.LinearLR(o, 0.1, total_iters=3),
                                                  S.ExponentialLR(o, 0.9)], milestones=[3]),
    "ChainedScheduler": lambda o: S.ChainedScheduler([S.ConstantLR(o, 0.5, total_iters=3),
                                                      S.ExponentialLR(o, 0.9)]),
    "ReduceLROnPlateau": lambda o: S.ReduceLROnPlateau(o, patience=1, factor=0.5),
    "CyclicLR": lambda o: S.CyclicLR(o, base_lr=1e-3, max_lr=1e-2, step_size_up=3,
                                     cycle_momentum="momentum" in o.defaults or "betas" in o.defaults),
    "OneCycleLR": lambda o: S.OneCycleLR(o, max_lr=2e-2, total_steps=12),
}

# optimizers whose momentum/beta1 OneCycleLR and CyclicLR cycle
CASES = [(s, n) for s in SCHEDULERS for n in ("sgd", "adam", "adamw", "rmsprop", "lion")]
# the others under a few, the ones with betas under those that also cycle beta1
CASES += [(s, n) for s in ("CyclicLR", "ExponentialLR") for n in ("adamax", "adadelta", "radam", "nadam", "rprop",
                                                                   "asgd")]
CASES += [("OneCycleLR", n) for n in ("adamax", "radam", "nadam")]  # (NAdam's mu_product keeps each beta1 it saw)
# Muon and NorMuon: the cyclers cycle their momentum, as for torch.optim.Muon (their defaults do not list the AdamW
# groups' betas)
CASES += [(s, n) for s in ("OneCycleLR", "CyclicLR", "ExponentialLR") for n in ("muon", "normuon")]
CASES += [(s, "adafactor") for s in ("CyclicLR", "ExponentialLR")]


@pytest.mark.parametrize("sched,name", CASES)
def test_scheduler_drives_fastoptim_like_torch(sched, name):
    spec = OPTIMIZERS[name]
    opts = dict(spec.option_sets[1])
    if name == "sgd":
        opts["momentum"] = 0.9  # cyclers need a momentum to cycle
    ours_p = make_params(name=name)
    ref_p = clone_params(ours_p)
    ours = spec.cls(ours_p, **opts)
    ref = reference_class(spec)(ref_p, **opts, **reference_kwargs(spec))
    s_ours, s_ref = SCHEDULERS[sched](ours), SCHEDULERS[sched](ref)
    seen_lrs = set()
    for step in range(1, 13):
        set_grads(step, [ours_p, ref_p])
        ours.step()
        ref.step()
        if sched == "ReduceLROnPlateau":
            metric = 1.0 if step < 3 else 2.0  # stops improving: the lr must drop
            s_ours.step(metric)
            s_ref.step(metric)
        else:
            s_ours.step()
            s_ref.step()
        assert [g["lr"] for g in ours.param_groups] == [g["lr"] for g in ref.param_groups]
        seen_lrs.add(ours.param_groups[0]["lr"])
        for key in ("betas", "momentum"):
            if key in ref.param_groups[0]:
                assert ours.param_groups[0][key] == ref.param_groups[0][key]
        assert_params_close(ours_p, ref_p)
    assert len(seen_lrs) > 1  # the schedule really moved the lr
    assert s_ours.state_dict().keys() == s_ref.state_dict().keys()
