"""``fastoptim.integrations.timm.register()``: every fastoptim optimizer in timm's optimizer factory.

Two parts:
* with timm itself, in a fresh process (tests/timm_worker.py): as it is where it imports, else (as here: the
  torchvision the index offers beside the CPU torch does not load, see DESIGN.md) with torchvision stubbed out in
  that process, which timm's optimizer factory never uses; each skips, saying why, where the other runs;
* everywhere, against a stand-in: ``FakeOptimInfo`` has the fields of timm's ``OptimInfo`` (checked against the
  installed timm's source, read without importing it), and ``FakeRegistry`` keeps timm's ``register(OptimInfo)``
  contract and does what timm 1.0's ``OptimizerRegistry.create_optimizer`` does with an OptimInfo (the steps are
  named in its body). Optimizers made that way must step as the ones built directly do (bit for bit), and as
  torch.optim's made the same way (AdamW, SGD).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import os
import pathlib
import subprocess
import sys
from typing import Any, Optional

import pytest
import torch
from torch import nn

import fastoptim
from fastoptim.integrations import timm as timm_glue
from fastoptim.registry import OPTIMIZERS


# --- the stand-in ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class FakeOptimInfo:
    name: str
    opt_class: Any
    description: str = ''
    has_eps: bool = True
    has_momentum: bool = False
    has_betas: bool = False
    num_betas: int = 2
    second_order: bool = False
    defaults: Optional[dict] = None


def _timm_groups(model, weight_decay):
    """timm's param_groups_weight_decay (no fallback_list): one group without decay, or 1-d params and biases
    without decay and the others with it."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not weight_decay:
        return [{"params": [p for _, p in named], "weight_decay": 0.0}]
    no_decay = [p for n, p in named if p.ndim <= 1 or n.endswith(".bias")]
    decay = [p for n, p in named if not (p.ndim <= 1 or n.endswith(".bias"))]
    groups = [{"params": no_decay, "weight_decay": 0.0}, {"params": decay, "weight_decay": weight_decay}]
    return [g for g in groups if g["params"]]


class FakeRegistry:
    def __init__(self):
        self.infos = {}

    def register(self, info):
        self.infos[info.name.lower()] = info

    def create_optimizer(self, model_or_params, opt, lr=None, weight_decay=0.0, momentum=0.9, foreach=None,
                         **kwargs):
        if isinstance(model_or_params, nn.Module):  # groups made here carry the decay: the optimizer gets 0
            params, weight_decay = _timm_groups(model_or_params, weight_decay), 0.0
        else:
            params = model_or_params
        info = self.infos[opt.lower().split("_")[-1]]  # ("lookahead_adamw": the name is the last part)
        opt_args = {"weight_decay": weight_decay, **kwargs}
        if lr is not None:
            opt_args["lr"] = lr
        for k, v in (info.defaults or {}).items():
            opt_args.setdefault(k, v)
        if info.has_momentum:
            opt_args.setdefault("momentum", momentum)
        if not info.has_eps:
            opt_args.pop("eps", None)
        if not info.has_betas:
            opt_args.pop("betas", None)
        if foreach is not None:
            opt_args.setdefault("foreach", foreach)
        return info.opt_class(params, **opt_args)


def _timm_source():
    """The installed timm's optimizer factory source, found without importing timm (None: no timm)."""
    spec = importlib.util.find_spec("timm")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = pathlib.Path(spec.submodule_search_locations[0]) / "optim" / "_optim_factory.py"
    return path.read_text() if path.exists() else None


def test_the_stand_in_has_the_fields_of_timms_optim_info():
    source = _timm_source()
    if source is None:
        pytest.skip("timm is not installed: nothing to check the stand-in's OptimInfo fields against")
    tree = ast.parse(source)
    info = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "OptimInfo")
    fields = [(s.target.id, ast.literal_eval(s.value) if s.value is not None else dataclasses.MISSING)
              for s in info.body if isinstance(s, ast.AnnAssign)]
    ours = [(f.name, f.default) for f in dataclasses.fields(FakeOptimInfo)]
    assert fields == ours
    # and the factory reads the name after the last underscore (why the names take a hyphen)
    assert "opt_split = opt.lower().split('_')" in source and "opt_name = opt_split[-1]" in source


# --- registration -----------------------------------------------------------------------------------------------

@pytest.fixture
def registry():
    reg = FakeRegistry()
    reg.register(FakeOptimInfo("adamw", torch.optim.AdamW, has_betas=True))  # timm's own entries
    reg.register(FakeOptimInfo("sgd", torch.optim.SGD, has_eps=False, has_momentum=True,
                               defaults={"nesterov": True}))
    names = timm_glue.register(reg, FakeOptimInfo)
    assert names == [f"fastoptim-{n}" for n in OPTIMIZERS]
    return reg


def test_every_optimizer_is_registered_with_what_it_takes(registry):
    for name, spec in OPTIMIZERS.items():
        info = registry.infos[f"fastoptim-{name}"]
        defaults = spec.cls.rule.defaults
        assert "_" not in info.name  # timm's factory would read only the part after it
        assert info.has_momentum == ("momentum" in defaults)
        assert info.has_betas == ("betas" in defaults)
        assert info.has_eps == isinstance(defaults.get("eps"), float)
        assert info.defaults is None and not info.second_order
        assert f"fastoptim.{spec.cls.__name__}" in info.description
    # timm's own entries stay; an underscore name would have reached them
    assert registry.infos["adamw"].opt_class is torch.optim.AdamW
    assert registry.create_optimizer(_model().parameters(), "fastoptim_adamw").__class__ is torch.optim.AdamW


def test_register_without_timm_says_what_it_needs(monkeypatch):
    monkeypatch.setitem(sys.modules, "timm", None)  # (import timm fails, whether it is installed or not)
    with pytest.raises(ImportError, match=r"needs timm with its optimizer registry"):
        timm_glue.register()


# --- what the factory makes -------------------------------------------------------------------------------------

def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def _run(opt, model, steps=3):
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


# what timm's train script passes where the user gives --opt-eps / --opt-betas / --momentum
# (as many betas as the optimizer takes: timm's ``num_betas``)
USER_ARGS = {"eps": 1e-7, "betas": (0.8, 0.9, 0.99), "momentum": 0.5}


def _user_args(has, num_betas):
    """USER_ARGS that an optimizer takes (``has(name)``), with its number of betas."""
    args = {k: v for k, v in USER_ARGS.items() if has(k)}
    if "betas" in args:
        args["betas"] = args["betas"][:num_betas]
    return args


def _direct(name, model, weight_decay, **kwargs):
    """The optimizer built without timm, from what timm hands it."""
    info_like = timm_glue.optim_info_kwargs(OPTIMIZERS[name])
    args = _user_args(lambda k: info_like[f"has_{k}"], info_like["num_betas"])
    groups = _timm_groups(model, weight_decay)
    if name == "rprop":  # (timm's weight_decay=0 dropped)
        groups = [{"params": g["params"]} for g in groups]
        return OPTIMIZERS[name].cls(groups, lr=1e-2, **kwargs)
    if OPTIMIZERS[name].params == "matrices":  # matrices with both dims above 1 on (Nor)Muon; the rest on AdamW
        routed = []
        for g in groups:
            routed += [{**g, "params": [p for p in g["params"] if p.dim() == 2]},
                       {**g, "params": [p for p in g["params"] if p.dim() != 2], "use_muon": False}]
        groups = [g for g in routed if g["params"]]
    return OPTIMIZERS[name].cls(groups, lr=1e-2, weight_decay=0.0, **args, **kwargs)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_factory_makes_what_building_it_directly_makes(registry, name):
    weight_decay = 0.0 if name == "rprop" else 0.05
    ours_model, ref_model = _model(), _model()
    info = registry.infos[f"fastoptim-{name}"]
    user = _user_args(lambda k: getattr(info, f"has_{k}"), info.num_betas)
    opt = registry.create_optimizer(ours_model, f"fastoptim-{name}", lr=1e-2, weight_decay=weight_decay, **user)
    assert isinstance(opt, OPTIMIZERS[name].cls)
    ref = _direct(name, ref_model, weight_decay)
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == \
        [{k: v for k, v in g.items() if k != "params"} for g in ref.param_groups]
    for a, b in zip(_run(opt, ours_model), _run(ref, ref_model)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name,settings", [("adamw", {}), ("sgd", {"nesterov": True})])
def test_the_factory_steps_as_timms_own_torch_optim_entry(registry, name, settings):
    ours_model, ref_model = _model(), _model()
    opt = registry.create_optimizer(ours_model, f"fastoptim-{name}", lr=1e-2, weight_decay=0.05, **settings)
    ref = registry.create_optimizer(ref_model, name, lr=1e-2, weight_decay=0.05, foreach=False)
    for a, b in zip(_run(opt, ours_model), _run(ref, ref_model)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_fastoptim_settings_pass_through_the_factory(registry):
    model = nn.Sequential(nn.Linear(64, 80), nn.Linear(80, 3))
    opt = registry.create_optimizer(model, "fastoptim-adamw", lr=1e-3, weight_decay=0.05, state_bits=8,
                                    min_quant_size=0, flat=True, impl="foreach", max_grad_norm=1.0)
    assert (opt.state_bits, opt.flat, opt.impl, opt.max_grad_norm) == (8, True, "foreach", 1.0)
    ref_model = nn.Sequential(nn.Linear(64, 80), nn.Linear(80, 3))
    ref_model.load_state_dict(model.state_dict())
    ref = fastoptim.AdamW(_timm_groups(ref_model, 0.05), lr=1e-3, weight_decay=0.0, state_bits=8,
                          min_quant_size=0, flat=True, impl="foreach", max_grad_norm=1.0)
    x = torch.randn(4, 64)
    for o, m in ((opt, model), (ref, ref_model)):
        for _ in range(2):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    assert isinstance(opt.state[model[0].weight]["exp_avg"], fastoptim.storage.QuantizedState)
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)


def test_rprop_drops_timms_zero_weight_decay_and_refuses_another(registry):
    model = _model()
    registry.create_optimizer(model, "fastoptim-rprop", lr=1e-2)  # timm's default weight_decay=0: fine
    with pytest.raises(TypeError, match="Rprop takes no weight_decay"):
        registry.create_optimizer(model, "fastoptim-rprop", lr=1e-2, weight_decay=0.05)


def test_muon_routes_params_as_timms_muon_and_honours_use_fallback(registry):
    model = _model()
    groups = _timm_groups(model, 0.05)
    head = model[4].weight
    groups[1]["params"] = [p for p in groups[1]["params"] if p is not head]
    groups.append({"params": [head], "weight_decay": 0.05, "use_fallback": True})  # timm's fallback_list=
    vector_row = nn.Parameter(torch.randn(1, 8))  # two dims but one of them 1: AdamW, as in timm's Muon
    # 3+ dims: conv filters on Muon, flattened as timm's Muon flattens them; a position table, a depthwise
    # filter and a layer scale (a 1 among their first two dims) on AdamW
    conv, conv1d = nn.Parameter(torch.randn(8, 3, 3, 3)), nn.Parameter(torch.randn(8, 4, 3))
    others = [nn.Parameter(torch.randn(s)) for s in [(1, 5, 8), (8, 1, 3, 3), (8, 1, 1)]]
    groups.append({"params": [vector_row, conv, conv1d, *others]})
    opt = registry.create_optimizer(groups, "fastoptim-muon", lr=1e-2)
    on_muon = {id(p) for g in opt.param_groups if g["use_muon"] for p in g["params"]}
    assert on_muon == {id(model[0].weight), id(model[2].weight), id(conv), id(conv1d)}
    assert all("use_fallback" not in g for g in opt.param_groups)
    flattened = [g for g in opt.param_groups if g["use_muon"] and g["matrices"] == "flatten"]
    assert [[id(p) for p in g["params"]] for g in flattened] == [[id(conv), id(conv1d)]]


# --- with timm itself, in a fresh process (tests/timm_worker.py) ------------------------------------------------

WORKER = pathlib.Path(__file__).with_name("timm_worker.py")


def _python(*args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(pathlib.Path(fastoptim.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600, env=env)


def _importable_timm():
    """None where ``import timm.optim`` works in a fresh process, else why not (its last line)."""
    if importlib.util.find_spec("timm") is None:
        return "ModuleNotFoundError: timm is not installed"
    probe = _python("-c", "import timm.optim")
    return None if probe.returncode == 0 else probe.stderr.strip().splitlines()[-1]


def test_with_timm_the_factory_makes_fastoptim_optimizers():
    why = _importable_timm()
    if why is not None:
        pytest.skip(f"timm cannot be imported here ({why}); test_with_timm_and_torchvision_stubbed and the "
                    "stand-in tests cover the registration")
    run = _python(str(WORKER))
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]


def test_with_timm_and_torchvision_stubbed():
    """timm's own factory code, where timm is installed but its torchvision does not load (as here): the worker
    puts an empty torchvision in its own process (timm's optimizers never use it)."""
    if importlib.util.find_spec("timm") is None:
        pytest.skip("timm is not installed")
    if _importable_timm() is None:
        pytest.skip("timm imports as it is: test_with_timm_the_factory_makes_fastoptim_optimizers runs it")
    run = _python(str(WORKER), "--stub-torchvision")
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]
