"""state_dict interchange with torch.optim, and bit-identical save -> load -> continue within fastoptim."""

import copy
import io

import pytest
import torch

import fastoptim
from conftest import CASES, assert_params_close, clone_params, make_params, set_grads, two_groups
from fastoptim.levels import LEVELS
from fastoptim.registry import OPTIMIZERS
from fastoptim.reference import reference_class, reference_kwargs


def _roundtrip(sd):
    """Through bytes, as a checkpoint on disk would go (weights_only, torch's default loader)."""
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _run(opt, params, steps, start=1, others=()):
    for step in range(start, start + steps):
        set_grads(step, [params, *others])
        opt.step()


TORCH_CASES = [(n, i) for n, i in CASES if OPTIMIZERS[n].reference is not None]


@pytest.mark.parametrize("name,index", TORCH_CASES)
def test_torch_checkpoint_loads_and_continues_as_torch(name, index):
    spec = OPTIMIZERS[name]
    opts = spec.option_sets[index]
    torch_p = make_params(name=name)
    torch_opt = reference_class(spec)(two_groups(torch_p, opts), **opts, **reference_kwargs(spec))
    _run(torch_opt, torch_p, 5)
    sd = _roundtrip(torch_opt.state_dict())
    ours_p = clone_params(torch_p)
    ours = spec.cls(two_groups(ours_p, opts), **opts)
    ours.load_state_dict(sd)
    _run(ours, ours_p, 6, start=6)
    _run(torch_opt, torch_p, 6, start=6)
    assert_params_close(ours_p, torch_p)


@pytest.mark.parametrize("name,index", TORCH_CASES)
def test_fastoptim_checkpoint_loads_into_torch(name, index):
    spec = OPTIMIZERS[name]
    opts = spec.option_sets[index]
    ours_p = make_params(name=name)
    ours = spec.cls(two_groups(ours_p, opts), **opts)
    _run(ours, ours_p, 5)
    sd = _roundtrip(ours.state_dict())
    for entry in sd["state"].values():  # torch's format: tensor steps, torch's names only
        assert set(entry) <= {"step", *spec.cls.rule.state_names, *spec.cls.rule.host_states}
        if spec.cls.rule.exports_step:
            assert isinstance(entry["step"], torch.Tensor) and entry["step"].dtype == torch.float32
    torch_p = clone_params(ours_p)
    torch_opt = reference_class(spec)(two_groups(torch_p, opts), **opts, **reference_kwargs(spec))
    torch_opt.load_state_dict(sd)
    _run(torch_opt, torch_p, 6, start=6)
    _run(ours, ours_p, 6, start=6)
    assert_params_close(ours_p, torch_p)


@pytest.mark.sample(("name", "index"), ("name", "load_level"), ("save_level", "load_level"))
@pytest.mark.parametrize("save_level", ["loop", "fused"])
@pytest.mark.parametrize("load_level", LEVELS)
@pytest.mark.parametrize("name,index", CASES)
def test_save_load_continue_is_bit_identical(name, index, save_level, load_level):
    spec = OPTIMIZERS[name]
    opts = spec.option_sets[index]
    straight_p = make_params(name=name)
    straight = spec.cls(two_groups(straight_p, opts), impl=save_level, **opts)
    _run(straight, straight_p, 4)
    sd = _roundtrip(straight.state_dict())
    saved_params = [p.detach().clone() for p in straight_p]
    straight.impl = load_level
    _run(straight, straight_p, 4, start=5)

    resumed_p = [torch.nn.Parameter(p) for p in saved_params]
    resumed = spec.cls(two_groups(resumed_p, opts), impl=load_level, **opts)
    resumed.load_state_dict(sd)
    _run(resumed, resumed_p, 4, start=5)
    for a, b in zip(straight_p, resumed_p):
        assert torch.equal(a, b)
    for a, b in zip(straight_p, resumed_p):
        for k, v in straight.state[a].items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(resumed.state[b][k])), k


KEPT_AS = {"fp32": torch.float32, "bf16": torch.bfloat16, "dynamic8": torch.uint8, "fp8": torch.uint8,
           "dynamic4": torch.uint8}  # each format's saved dtype (quantized: its codes')


@pytest.mark.parametrize("state_format", sorted(KEPT_AS))
def test_loading_does_not_alias_the_callers_checkpoint(state_format):
    """At every state format the loaded optimizer keeps states of its own: stepping it never writes into the
    caller's state_dict (a state saved in the very dtype it is kept in could otherwise be kept as is)."""
    p = make_params()
    kw = dict(lr=1e-2, state_format=state_format, min_quant_size=0)
    opt = OPTIMIZERS["adam"].cls(p, **kw)
    _run(opt, p, 2)
    sd = opt.state_dict()
    kept_as = KEPT_AS[state_format]
    name = "exp_avg.codes" if kept_as == torch.uint8 else "exp_avg"
    assert sd["state"][3][name].dtype == kept_as  # (the 7x5 param: saved in its format)
    snapshot = {k: {n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in s.items()}
                for k, s in sd["state"].items()}
    opt2 = OPTIMIZERS["adam"].cls(p, **kw)
    opt2.load_state_dict(sd)
    opt.load_state_dict(_roundtrip(sd))  # the first optimizer must stop writing into sd too
    _run(opt2, p, 2, start=3)
    _run(opt, p, 2, start=3)
    for k, s in snapshot.items():
        for n, v in s.items():
            same = torch.equal(sd["state"][k][n], v) if isinstance(v, torch.Tensor) else sd["state"][k][n] == v
            assert same, f"{state_format}: the caller's state {k} {n!r} changed"


def test_sgd_state_has_no_step_and_first_step_semantics_survive_reload():
    """torch's SGD keeps only momentum_buffer; a reloaded buffer must not be re-initialised from the grad."""
    p = make_params()
    opt = OPTIMIZERS["sgd"].cls(p, lr=0.1, momentum=0.9, dampening=0.5)
    _run(opt, p, 3)
    sd = opt.state_dict()
    assert all(set(s) == {"momentum_buffer"} for s in sd["state"].values())
    q = clone_params(p)
    ref = torch.optim.SGD(q, lr=0.1, momentum=0.9, dampening=0.5, foreach=False)
    ref.load_state_dict(sd)
    opt2 = OPTIMIZERS["sgd"].cls(clone_params(p), lr=0.1, momentum=0.9, dampening=0.5)
    opt2.load_state_dict(sd)
    r = opt2.param_groups[0]["params"]
    for step in range(4, 7):
        set_grads(step, [r, q])
        opt2.step()
        ref.step()
    assert_params_close(r, q)


# --- low-bit checkpoints: the layout saved before format ids, and errors that say how torch.optim takes one -------

def _low_bit(bits, steps=3):
    g = torch.Generator().manual_seed(7)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in ((48, 80), (80,), (16, 300))]
    opt = fastoptim.AdamW(params, lr=1e-2, weight_decay=0.1, state_bits=bits, min_quant_size=0)
    _run(opt, params, steps)
    return opt, params


@pytest.mark.parametrize("bits", [8, 4])
def test_a_checkpoint_with_the_string_format_entry_loads_and_continues_bit_identically(bits):
    """Checkpoints saved before format ids hold ``name.format`` as "tag [shape]": they still load, and the
    optimizer continues exactly as the one that saved them."""
    straight, straight_p = _low_bit(bits)
    sd = straight.state_dict()
    for index, p in enumerate(straight_p):  # the old layout, written out from the optimizer's own states
        entry = {k: v for k, v in sd["state"][index].items() if not k.endswith((".codes", ".absmax", ".format"))}
        for name, state in straight.state[p].items():
            if isinstance(state, fastoptim.storage.QuantizedState):
                entry.update({f"{name}.codes": state.codes.clone(), f"{name}.absmax": state.absmax.clone(),
                              f"{name}.format": f"{state.fmt.tag} {list(p.shape)}"})
        sd["state"][index] = entry
    assert sd["state"][0]["exp_avg.format"] == ("dynamic8s/256 [48, 80]" if bits == 8 else "dynamic4s/128 [48, 80]")
    resumed_p = [torch.nn.Parameter(p.detach().clone()) for p in straight_p]
    resumed = fastoptim.AdamW(resumed_p, lr=1e-2, weight_decay=0.1, state_bits=bits, min_quant_size=0)
    resumed.load_state_dict(_roundtrip(sd))
    assert resumed.state_dict()["state"][0]["exp_avg.format"] == straight.state[straight_p[0]]["exp_avg"].fmt.id
    _run(straight, straight_p, 4, start=4)
    _run(resumed, resumed_p, 4, start=4)
    for a, b in zip(straight_p, resumed_p):
        assert torch.equal(a, b)
    want, got = straight.state_dict()["state"], resumed.state_dict()["state"]
    for index, entry in want.items():
        assert got[index].keys() == entry.keys()
        for k, v in entry.items():
            assert torch.equal(v, got[index][k]) and v.dtype == got[index][k].dtype if isinstance(v, torch.Tensor) \
                else v == got[index][k], k


def test_errors_about_a_low_bit_checkpoints_entries_say_how_torch_optim_takes_one():
    opt, params = _low_bit(8, steps=1)
    good = opt.state_dict()
    fmt = good["state"][0]["exp_avg.format"]
    cases = [("exp_avg.format", 12345, r"unknown quantized state format id 12345 .*2028130850 \(dynamic8s/256\)"),
             ("exp_avg.format", float(fmt), "its format entry must be an int .*got float"),
             ("exp_avg.codes", torch.zeros(48, 79, dtype=torch.uint8),
              r"codes must be a uint8 tensor of shape \(48, 80\) for a param of shape \(48, 80\) "
              r"\(dynamic8s/256\), got uint8 \(48, 79\)"),
             ("exp_avg.format", None, r"state 'exp_avg.codes' .*\(no exp_avg.format entry says its format")]
    for key, value, why in cases:
        bad = copy.deepcopy(good)
        if value is None:
            del bad["state"][0][key]
        else:
            bad["state"][0][key] = value
        with pytest.raises(ValueError, match=why) as e:
            opt.load_state_dict(bad)
        assert "opt.torch_state_dict() gives one that torch.optim loads" in str(e.value), key
    torch_sd = opt.torch_state_dict()  # what torch.optim takes instead: it loads and steps
    ref = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone()) for p in params], lr=1e-2, weight_decay=0.1)
    ref.load_state_dict(torch_sd)
    _run(ref, ref.param_groups[0]["params"], 1, start=2)
