"""What a model's and an optimizer's own checkpointing writes is the same with fastoptim at every setting:
safetensors, torch.save/torch.load(weights_only=True), pickle and deepcopy, torch.distributed.checkpoint (DCP);
and torch.compile of a step function."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

import fastoptim

from .kinds import KIND_NAMES, KINDS, LR, TinyLM, tokens
from conftest import STORED, quantized

BATCHES = tokens(24).split(4)


def train_steps(model, opt, steps):
    for i in steps:
        ids = BATCHES[i].to(next(model.parameters()).device)
        loss = torch.nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()


def setup(kind, steps=range(3), device="cpu"):
    torch.manual_seed(0)
    model = TinyLM().to(device)
    opt = KINDS[kind].make(model)
    train_steps(model, opt, steps)
    return model, opt


def assert_same(a: torch.nn.Module, b: torch.nn.Module):
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_safetensors_round_trip(kind, tmp_path, device):
    safetensors = pytest.importorskip("safetensors.torch")
    model, opt = setup(kind, device=device)
    safetensors.save_model(model, str(tmp_path / "m.safetensors"))
    safetensors.save_file(model.state_dict(), str(tmp_path / "sd.safetensors"))
    loaded = TinyLM().to(device)
    missing, unexpected = safetensors.load_model(loaded, str(tmp_path / "m.safetensors"), device=device)
    assert not missing and not unexpected
    assert_same(model, loaded)
    assert set(safetensors.load_file(str(tmp_path / "sd.safetensors"))) == set(model.state_dict())
    # the optimizer state goes with torch.save; model and optimizer resumed equal a straight run
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    resumed_opt = KINDS[kind].make(loaded)
    resumed_opt.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
    train_steps(model, opt, range(3, 6))
    train_steps(loaded, resumed_opt, range(3, 6))
    assert_same(model, loaded)


def _dcp_resumed(bits, flatten, saved_model, directory):
    """A fresh model and optimizer resumed from ``directory`` through DCP, as torchtitan loads (one process)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    options = StateDictOptions(flatten_optimizer_state_dict=flatten)
    model = TinyLM()
    model.load_state_dict(saved_model)
    opt = fastoptim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, state_bits=bits)
    loaded = {"optim": get_optimizer_state_dict(model, opt, options=options)}  # DCP makes its state (lr 0 step)
    dcp.load(loaded, checkpoint_id=directory)
    set_optimizer_state_dict(model, opt, loaded["optim"], options=options)
    return model, opt


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # (one process, no process group: as meant)
@pytest.mark.parametrize("bits", (32, *STORED))
def test_dcp_save_load_continues_bit_identically(bits, tmp_path):
    """get_optimizer_state_dict -> dcp.save -> dcp.load -> set_optimizer_state_dict, with the optimizer state
    flattened (torchtitan's options: every entry must be a tensor, int, float or dict) and not: both resume
    exactly as the optimizer that never went through a checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    torch.manual_seed(0)
    model = TinyLM()
    opt = fastoptim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, state_bits=bits)
    train_steps(model, opt, range(3))
    if quantized(bits):
        assert any(isinstance(s, fastoptim.storage.QuantizedState) for e in opt.state.values() for s in e.values())
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    resumed = {}
    for flatten in (True, False):
        options = StateDictOptions(flatten_optimizer_state_dict=flatten)
        dcp.save({"optim": get_optimizer_state_dict(model, opt, options=options)},
                 checkpoint_id=tmp_path / str(flatten))
        resumed[flatten] = _dcp_resumed(bits, flatten, saved_model, tmp_path / str(flatten))
    train_steps(model, opt, range(3, 6))
    want = opt.state_dict()
    for flatten, (resumed_model, resumed_opt) in resumed.items():
        train_steps(resumed_model, resumed_opt, range(3, 6))
        assert_same(model, resumed_model)
        got = resumed_opt.state_dict()
        assert got["param_groups"] == want["param_groups"]
        for index, entry in want["state"].items():
            assert got["state"][index].keys() == entry.keys(), flatten
            for k, v in entry.items():
                w = got["state"][index][k]
                assert (torch.equal(v, w) and v.dtype == w.dtype) if isinstance(v, torch.Tensor) else v == w, k
    assert_same(*(m for m, _ in resumed.values()))  # flattened and not: the same optimizer


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_model_state_dict_unchanged_by_settings(kind, tmp_path):
    """torch.save of the model writes each param's own bytes: the file is the size a plain model's is."""
    model, _ = setup(kind)
    plain = TinyLM()
    sizes = []
    for m in (model, plain):
        buffer = io.BytesIO()
        torch.save(m.state_dict(), buffer)
        sizes.append(len(buffer.getvalue()))
    assert sizes[0] == pytest.approx(sizes[1], rel=0.01)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("kind", KIND_NAMES)
def test_copies_continue_as_the_original(kind, how, device):
    model, opt = setup(kind, device=device)
    if how == "deepcopy":
        model2, opt2 = copy.deepcopy((model, opt))
    else:
        model2, opt2 = pickle.loads(pickle.dumps((model, opt)))
    assert opt2.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
    train_steps(model, opt, range(3, 6))
    train_steps(model2, opt2, range(3, 6))
    assert_same(model, model2)


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_pickle_size(kind):
    """An optimizer pickles to about the size of its state (flat mode's views do not each carry the buffer)."""
    _, opt = setup(kind)
    _, reference = setup("32")
    size, reference_size = len(pickle.dumps(opt)), len(pickle.dumps(reference))
    assert size < 2.5 * reference_size, (size, reference_size)


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_compiled_step_function(kind, device):
    """torch.compile of a function that calls opt.step(), as PyTorch's docs teach: eager's numbers."""
    torch._dynamo.reset()
    model, opt = setup(kind, steps=(), device=device)
    eager, eager_opt = setup(kind, steps=(), device=device)

    @torch.compile
    def step():
        opt.step()

    for i in range(3):
        for m, o, s in ((model, opt, step), (eager, eager_opt, eager_opt.step)):
            ids = BATCHES[i].to(device)
            torch.nn.functional.cross_entropy(m(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten()).backward()
            s()
            o.zero_grad()
    assert_same(model, eager)
