"""``state_format=``: the state formats by name (``storage.codecs``), with ``state_bits=`` as its alias.

Both spellings make the same optimizer: the same steps, the same state_dict and param groups (which carry
``state_bits``, as before, so checkpoints and torch.optim interchange do not change). A name that is no format,
or two settings that disagree, are refused with an error naming them, and nothing is made."""

import pytest
import torch

import fastoptim
from fastoptim.levels import record_paths
from fastoptim.storage import codecs

SPELLINGS = [(32, "fp32"), (32, "plain"), (16, "bf16"), (8, "dynamic8"), (8, "int8"), (4, "dynamic4"), (4, "int4")]


def _steps(impl, **setting):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(96, 80), torch.nn.Linear(80, 8))
    opt = fastoptim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, impl=impl, min_quant_size=0, **setting)
    with record_paths() as paths:
        for _ in range(4):
            for p in model.parameters():
                p.grad = torch.randn_like(p)
            opt.step()
    return model, opt, paths


def _assert_same(a, b, ordered=True):
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b) if ordered else sorted(a, key=str) == sorted(b, key=str)
        for k in a:
            _assert_same(a[k], b[k], ordered)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y, ordered)
    else:
        assert a == b


@pytest.mark.parametrize("impl", ["loop", "fused"])
@pytest.mark.parametrize("bits,name", SPELLINGS)
def test_a_format_by_name_steps_and_saves_as_its_state_bits(bits, name, impl):
    by_bits, opt_bits, paths_bits = _steps(impl, state_bits=bits)
    by_name, opt_name, paths_name = _steps(impl, state_format=name)
    assert paths_name == paths_bits  # the same paths ran
    for p, q in zip(by_bits.parameters(), by_name.parameters()):
        assert torch.equal(p, q)
    _assert_same(opt_bits.state_dict(), opt_name.state_dict())
    assert opt_name.state_bits == bits  # what the optimizer (and a group that sets its own) carries
    # both given and agreeing is the same optimizer too
    _, opt_both, _ = _steps(impl, state_bits=bits, state_format=name)
    _assert_same(opt_bits.state_dict(), opt_both.state_dict())


def test_a_checkpoint_saved_with_state_bits_loads_into_state_format():
    _, saved, _ = _steps("loop", state_bits=8)
    _, fresh, _ = _steps("loop", state_format="dynamic8")
    fresh.load_state_dict(saved.state_dict())
    _assert_same(saved.state_dict(), fresh.state_dict(), ordered=False)  # a load puts ``step`` first


def test_an_unknown_name_is_refused_naming_the_valid_ones():
    model = torch.nn.Linear(4, 4)
    for bad in ("int3", "fp8", 8, "dynamic16"):
        with pytest.raises(ValueError, match=r"Invalid state_format: .*'fp32'.*'bf16'.*'dynamic8'.*'dynamic4'"):
            fastoptim.Adam(model.parameters(), state_format=bad)


def test_state_bits_and_state_format_that_disagree_are_refused_naming_both():
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"state_bits=8 and state_format='bf16'"):
        fastoptim.SGD(model.parameters(), state_bits=8, state_format="bf16")
    with pytest.raises(ValueError, match=r"state_bits=32 and state_format='int4'"):
        fastoptim.SGD(model.parameters(), state_bits=32, state_format="int4")


@pytest.mark.parametrize("name", [spec for spec in fastoptim.OPTIMIZERS])
def test_every_optimizer_takes_state_format(name):
    cls = fastoptim.OPTIMIZERS[name].cls
    opt = cls([torch.nn.Parameter(torch.zeros(4, 4))], state_format="bf16")
    assert opt.state_bits == 16


def test_each_codec_names_its_bits_and_is_found_by_its_names():
    for bits, name in SPELLINGS:
        assert codecs.lookup(name).bits == bits
        assert codecs.for_bits(bits) is codecs.lookup(name)
