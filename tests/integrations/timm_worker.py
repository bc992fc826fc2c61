"""Run by tests/integrations/test_timm.py in a fresh process: fastoptim's optimizers through timm's own factory.

``--stub-torchvision``: timm imports torchvision at import time (its layers and data modules), though its optimizer
factory never uses it; where the installed torchvision does not load beside this torch, an empty stand-in module
for every ``torchvision.*`` lets timm import. Only in this process: the stand-in never reaches the test session.
Prints "ok" at the end.
"""

import importlib.abc
import importlib.machinery
import sys
import types


class _Anything(type):
    """A class whose every attribute is another such class and whose calls return one: enough for timm's
    module-level uses of torchvision (imports, ``InterpolationMode.BILINEAR``, base classes)."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything(name, (object,), {})

    def __call__(cls, *args, **kwargs):
        return _Anything("result", (object,), {})


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything(name, (object,), {})


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def main():
    if "--stub-torchvision" in sys.argv:
        sys.meta_path.insert(0, _StubFinder())
    import torch
    import timm.optim
    from torch import nn

    import fastoptim
    from fastoptim.integrations import timm as timm_glue

    names = timm_glue.register()
    assert set(names) <= set(timm.optim.list_optimizers("fastoptim-*")), timm.optim.list_optimizers("fastoptim-*")

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))

    def run(opt, m, steps=3):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
        for _ in range(steps):
            opt.zero_grad()
            m(x).square().mean().backward()
            opt.step()
        return list(m.parameters())

    # every optimizer: timm's factory makes it, with timm's groups, and it steps
    for name in fastoptim.OPTIMIZERS:
        m = model()
        wd = 0.0 if name == "rprop" else 0.05
        opt = timm.optim.create_optimizer_v2(m, f"fastoptim-{name}", lr=1e-2, weight_decay=wd)
        assert isinstance(opt, fastoptim.OPTIMIZERS[name].cls), (name, type(opt))
        before = [p.detach().clone() for p in m.parameters()]
        after = run(opt, m)
        assert any(not torch.equal(a, b) for a, b in zip(after, before)), name

    # AdamW and SGD step as timm's own torch.optim entries
    # (timm's "sgd" is Nesterov by its defaults; fastoptim-sgd keeps torch's, as timm's "momentum" does)
    for name, theirs in (("adamw", "adamw"), ("sgd", "momentum")):
        ours_m, ref_m = model(), model()
        ours = timm.optim.create_optimizer_v2(ours_m, f"fastoptim-{name}", lr=1e-2, weight_decay=0.05)
        ref = timm.optim.create_optimizer_v2(ref_m, theirs, lr=1e-2, weight_decay=0.05, foreach=False)
        for a, b in zip(run(ours, ours_m), run(ref, ref_m)):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)

    # fastoptim's settings pass through; Lookahead wraps; an underscore name would reach timm's own AdamW
    low = timm.optim.create_optimizer_v2(model(), "fastoptim-adamw", lr=1e-3, state_bits=8, flat=True,
                                         impl="foreach")
    assert (low.state_bits, low.flat, low.impl) == (8, True, "foreach")
    m = model()
    wrapped = timm.optim.create_optimizer_v2(m, "lookahead_fastoptim-adamw", lr=1e-3)
    assert isinstance(wrapped, timm.optim.Lookahead) and isinstance(wrapped._base_optimizer, fastoptim.AdamW)
    run(wrapped, m)
    assert type(timm.optim.create_optimizer_v2(model(), "fastoptim_adamw", lr=1e-3)) is not fastoptim.AdamW

    # Muon: matrices on Muon, the rest and timm's fallback_list on AdamW
    m = model()
    muon = timm.optim.create_optimizer_v2(m, "fastoptim-muon", lr=1e-2, weight_decay=0.05, fallback_list=["4.*"])
    on_muon = {id(p) for g in muon.param_groups if g["use_muon"] for p in g["params"]}
    assert on_muon == {id(m[0].weight), id(m[2].weight)}, on_muon
    run(muon, m)
    print("ok")


if __name__ == "__main__":
    main()
