"""Optimizers declared once: a rule carries its names, signature, oracle and test options, and everything else
comes from the registry (``fastoptim.rules.base``, ``fastoptim.registry``)."""

import inspect
import os
import subprocess
import sys

import pytest
import torch

import fastoptim
from fastoptim import registry
from fastoptim.rules.base import Rule, register

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/, where registry_plugin lives


def test_every_public_class_has_torchs_signature_and_comes_from_its_rule():
    for name, spec in registry.OPTIMIZERS.items():
        cls = getattr(fastoptim, spec.cls.__name__)
        assert cls is spec.cls and cls.rule.name == name and cls.__name__ in fastoptim.__all__
        torch_cls = getattr(torch.optim, spec.torch_counterpart or "", None)
        if torch_cls is None:
            continue
        ours, theirs = inspect.signature(cls).parameters, inspect.signature(torch_cls).parameters
        for arg, param in theirs.items():  # torch's names and defaults
            if arg in ("capturable", "differentiable", "decoupled_weight_decay") and arg not in ours:
                continue
            assert arg in ours, (name, arg)
            if arg not in ("foreach", "fused"):
                assert ours[arg].default == param.default, (name, arg)
        positional = [a for a, p in ours.items() if p.kind == p.POSITIONAL_OR_KEYWORD and a in theirs]
        assert positional == [a for a in theirs if a in positional], name  # in torch's order


def test_a_misspelled_scalar_is_refused_when_the_rule_is_registered():
    class Misspelled(Rule):
        name = "misspelled"
        defaults = dict(lr=0.1)
        state_names = ()
        update = staticmethod(lambda p, g, lr, MAXIMIZE: (p - lr * g,))

        def validate(self, group):
            pass

        def named_flags(self, group):
            return dict(MAXIMIZE=False)

        def named_scalars(self, group, step):
            return dict(learning_rate=group["lr"])

    with pytest.raises(TypeError, match=r"named_scalars\(\) gives \('learning_rate',\).*takes \('lr',\).*"
                                        r"unknown \['learning_rate'\]; missing \['lr'\]"):
        register(Misspelled)
    assert "misspelled" not in registry.OPTIMIZERS


def test_flags_before_scalars_or_a_positional_scalars_method_are_refused_when_the_class_is_defined():
    with pytest.raises(TypeError, match="FLAGS .* must follow its scalars"):
        class Swapped(Rule):  # noqa: F841
            state_names = ()
            update = staticmethod(lambda p, g, MAXIMIZE, lr: (p,))
    with pytest.raises(TypeError, match=r"defines scalars\(\): define named_scalars\(\)"):
        class Positional(Rule):  # noqa: F841
            state_names = ()
            update = staticmethod(lambda p, g, lr: (p,))

            def scalars(self, group, step):
                return (group["lr"],)


def test_the_levels_get_the_named_scalars_in_updates_order():
    rule = fastoptim.AdamW.rule
    group = {**rule.defaults, "lr": 0.5, "weight_decay": 0.1}
    named = rule.named_scalars(group, 3)
    assert rule.scalar_names == tuple(inspect.signature(rule.update).parameters)[5:13]
    assert rule.scalars(group, 3) == tuple(named[n] for n in rule.scalar_names)
    assert rule.flag_names == ("MAXIMIZE", "WEIGHT_DECAY", "DECOUPLED", "AMSGRAD")


@pytest.mark.slow
def test_a_rule_added_to_the_registry_gets_the_whole_matrix():
    """A test-only rule registered before collection (tests/registry_plugin.py) is collected by the parity,
    stateful, low-bit, CPU-kernel and Triton matrices with no test table edited, runs at the loop and fused
    levels against its oracle, and is not exported."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])}
    files = ["surface/test_parity.py", "surface/test_stateful.py", "storage/test_low_bit.py", "paths/test_cpu_kernels.py",
             "paths/test_triton.py", "engine/test_levels_extra.py", "surface/test_torch_optim_db.py"]
    collected = subprocess.run([sys.executable, "-m", "pytest", "-p", "registry_plugin", "--collect-only", "-q",
                                *files], cwd=HERE, env=env, capture_output=True, text=True, timeout=600)
    assert collected.returncode == 0, collected.stdout[-3000:] + collected.stderr[-3000:]
    ids = [line for line in collected.stdout.splitlines() if "tinyema" in line]
    for file in files[:-1]:  # (torch's data has nothing for an optimizer torch lacks)
        assert any(f"{file}::" in i for i in ids), (file, collected.stdout[-2000:])
    assert any("surface/test_parity.py::test_matches_reference_every_step" in i for i in ids)
    ran = subprocess.run([sys.executable, "-m", "pytest", "-p", "registry_plugin", "-q", "-x",
                          "surface/test_parity.py::test_matches_reference_every_step", "-k", "tinyema and (loop or fused)"],
                         cwd=HERE, env=env, capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0 and " passed" in ran.stdout, ran.stdout[-3000:] + ran.stderr[-3000:]
    assert "tinyema" not in registry.OPTIMIZERS and "TinyEMA" not in fastoptim.__all__
    program = ("import torch, registry_plugin, fastoptim; print('TinyEMA' in fastoptim.__all__, "
               "hasattr(fastoptim, 'TinyEMA'), fastoptim.create([torch.nn.Parameter(torch.ones(2))], 'tinyema')"
               ".__class__.__name__)")
    leaked = subprocess.run([sys.executable, "-c", program], cwd=HERE, env=env, capture_output=True, text=True,
                            timeout=300)
    assert leaked.stdout.split() == ["False", "False", "TinyEMA"], leaked.stdout + leaked.stderr
