"""Runs that tests in several folders share: compiled-frame counts, a GradScaler run, hyper-parameters as
0-d tensors."""

import torch

from conftest import make_params, set_grads
from fastoptim.registry import OPTIMIZERS


def frames_compiled() -> int:
    from torch._dynamo.utils import counters
    return sum(counters["frames"].values())


def scaler_run(opt_factory, params, steps=4, poison_step=2):
    """A tiny model trained under torch.amp.GradScaler; one step gets an inf grad."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1000)
    opt = opt_factory(params)
    x = torch.linspace(-1, 1, 24).reshape(6, 4)
    record = []
    for step in range(1, steps + 1):
        opt.zero_grad()
        loss = (x @ params[0]).pow(2).sum() + params[1].sum()
        scaler.scale(loss).backward()
        if step == poison_step:
            params[1].grad.view(-1)[0] = float("inf")
        before = [p.detach().clone() for p in params]
        scale_before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        record.append((before, [p.detach().clone() for p in params], scale_before, scaler.get_scale()))
    return opt, record


# the hyper-parameters each optimizer takes as 0-d tensors: its rule says (``Rule.tensor_hypers``)
TENSOR_HYPER = {name: spec.cls.rule.tensor_hypers for name, spec in OPTIMIZERS.items()}


def as_tensors(group: dict, keys) -> None:
    for k in keys:
        v = group[k]
        group[k] = tuple(torch.tensor(float(b)) for b in v) if isinstance(v, tuple) else torch.tensor(float(v))


def run_with_tensor_hyperparameters(name, level, flat=False, steps=5):
    """The same run twice: hyper-parameters as Python floats, and as 0-d tensors written in place each step
    (as a device-side schedule would). Returns both param lists."""
    spec = OPTIMIZERS[name]
    opts = dict(spec.option_sets[1])
    if name in ("sgd", "rmsprop"):
        opts["momentum"] = 0.9
    runs = []
    for as_tensor in (False, True):
        params = make_params(name=name)
        opt = spec.cls(params, impl=level, flat=flat, **opts)
        if as_tensor:
            as_tensors(opt.param_groups[0], TENSOR_HYPER[name])
        for step in range(1, steps + 1):
            group = opt.param_groups[0]
            lr = opts["lr"] * (1 + 0.1 * step)
            if as_tensor:
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
            set_grads(step, [params], none_every=10 ** 9)
            opt.step()
        runs.append(params)
    return runs
