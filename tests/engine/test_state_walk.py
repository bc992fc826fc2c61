"""Code that walks ``optimizer.state`` to move its tensors (Lightning at the end of every ``fit()`` and on resume,
accelerate on ``prepare``, the helpers users write, deep copies, DCP) at every ``state_bits``: each walk works,
and the optimizer then steps exactly as an untouched twin given the same grads, params and state_dict bit for
bit, on the fast path it took before."""

import copy
import io
import pickle

import pytest
import torch
from torch import Tensor

import fastoptim
from fastoptim import storage
from fastoptim.levels import record_paths
from fastoptim.paths.cpu_kernel import kernels as cpu_kernels
from conftest import STORED, quantized

BITS = STORED
KW = dict(lr=1e-2, weight_decay=0.1, min_quant_size=0)  # the matrix is quantized at 8/4 bits, the vector never


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in ((48, 80), (80,), (3, 5))]


def _grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


def _run(opt, params, steps, start):
    for step in range(start, start + steps):
        _grads(params, step)
        opt.step()


def _twins(bits, flat):
    """Two optimizers stepped alike for three steps: one to walk, one left alone."""
    made = []
    for _ in range(2):
        params = _params()
        opt = fastoptim.AdamW(params, state_bits=bits, flat=flat, **KW)
        _run(opt, params, 3, 0)
        made.append((opt, params))
    return made


def _assert_same(a, b):
    assert type(a) is type(b) or isinstance(a, dict) and isinstance(b, dict), (type(a), type(b))
    if isinstance(a, Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))  # bit for bit
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


def _assert_twins(opt, params, twin, twin_params):
    for p, q in zip(params, twin_params):
        _assert_same(p.detach(), q.detach())
    ours, theirs = opt.state_dict(), twin.state_dict()
    _assert_same(ours["state"], theirs["state"])
    for group, other in zip(ours["param_groups"], theirs["param_groups"]):
        # torch's loader and __setstate__ add "differentiable": False to every group (torch's own key)
        assert {k: v for k, v in group.items() if k != "differentiable"} == \
            {k: v for k, v in other.items() if k != "differentiable"}


# --- the walks ----------------------------------------------------------------------------------------------

def _move(t):
    """A move to another place (this machine has one device: a copy on it, at another address)."""
    return t.to("cpu", copy=True)


def lightning_optimizer_to_device(opt, params):
    from lightning.fabric.utilities.optimizer import _optimizer_to_device

    _optimizer_to_device(opt, torch.device("cpu"))
    return opt, params


def lightning_apply_to_collection_whole_state(opt, params):
    from lightning_utilities.core.apply_func import apply_to_collection

    opt.state = apply_to_collection(opt.state, Tensor, _move)
    return opt, params


def lightning_apply_to_collection_per_param(opt, params):
    from lightning_utilities.core.apply_func import apply_to_collection

    for p, s in list(opt.state.items()):
        opt.state[p] = apply_to_collection(s, Tensor, _move)
    return opt, params


def lightning_apply_to_collection_per_value(opt, params):
    from lightning_utilities.core.apply_func import apply_to_collection

    for s in opt.state.values():
        for k, v in s.items():
            s[k] = apply_to_collection(v, Tensor, _move)
    return opt, params


def accelerate_send_to_device(opt, params):
    from accelerate.utils import send_to_device

    opt.state = send_to_device(opt.state, "cpu")
    return opt, params


def accelerate_send_to_device_per_param(opt, params):
    from accelerate.utils import send_to_device

    for p, s in list(opt.state.items()):
        opt.state[p] = send_to_device(s, "cpu", non_blocking=True)
    return opt, params


def accelerate_recursively_apply(opt, params):
    from accelerate.utils import recursively_apply

    opt.state = recursively_apply(_move, opt.state)  # tensors only: a quantized state is left as it is
    return opt, params


def accelerate_prepare_moves_the_state_dict(opt, params):
    from accelerate.optimizer import move_to_device  # what AcceleratedOptimizer does on prepare

    opt.load_state_dict(move_to_device(opt.state_dict(), torch.device("cpu")))
    return opt, params


def manual_helper(opt, params):
    device = params[0].device
    for s in opt.state.values():
        for k, v in s.items():
            if isinstance(v, Tensor):
                s[k] = v.to(device, copy=True)
    return opt, params


def _recursive_helper(movable):
    def to(obj):
        if movable(obj):
            return obj.to("cpu", copy=True)
        if isinstance(obj, dict):
            return type(obj)({k: to(v) for k, v in obj.items()})
        if isinstance(obj, (list, tuple)):
            return type(obj)(to(v) for v in obj)
        return obj

    def walk(opt, params):
        for p in list(opt.state):
            opt.state[p] = to(opt.state[p])
        return opt, params

    return walk


manual_recursive_helper = _recursive_helper(lambda obj: isinstance(obj, Tensor))  # a quantized state stays put
manual_recursive_helper.__name__ = "manual_recursive_helper"
manual_recursive_helper_by_to = _recursive_helper(lambda obj: hasattr(obj, "to"))
manual_recursive_helper_by_to.__name__ = "manual_recursive_helper_by_to"


def manual_helper_into_plain_dicts(opt, params):
    opt.state = {p: {k: _move(v) if isinstance(v, Tensor) else v for k, v in s.items()} for p, s in opt.state.items()}
    return opt, params


def deepcopy(opt, params):
    opt = copy.deepcopy(opt)
    return opt, [p for group in opt.param_groups for p in group["params"]]


def pickled(opt, params):
    opt = pickle.loads(pickle.dumps(opt))
    return opt, [p for group in opt.param_groups for p in group["params"]]


def torch_save_load_weights_only(opt, params):
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    fresh_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh = fastoptim.AdamW(fresh_params, state_bits=opt.state_bits, flat=opt.flat, **KW)
    fresh.load_state_dict(loaded)
    return fresh, fresh_params


WALKS = [lightning_optimizer_to_device, lightning_apply_to_collection_whole_state,
         lightning_apply_to_collection_per_param, lightning_apply_to_collection_per_value, accelerate_send_to_device,
         accelerate_send_to_device_per_param, accelerate_recursively_apply, accelerate_prepare_moves_the_state_dict,
         manual_helper, manual_recursive_helper, manual_recursive_helper_by_to, manual_helper_into_plain_dicts,
         deepcopy, pickled, torch_save_load_weights_only]
NEEDS = {"lightning": ("lightning", "lightning_utilities"), "accelerate": ("accelerate",)}  # by the walk's prefix


def _needs(walk):
    for module in NEEDS.get(walk.__name__.split("_")[0], ()):
        pytest.importorskip(module, reason=f"{module} is not installed")


@pytest.mark.sample
@pytest.mark.parametrize("walk", WALKS, ids=lambda w: w.__name__)
@pytest.mark.parametrize("bits,flat", [(b, f) for b in (32, *BITS) for f in (False, True)])
def test_a_walk_over_the_state_leaves_the_optimizer_stepping_as_its_untouched_twin(walk, bits, flat):
    _needs(walk)
    (opt, params), (twin, twin_params) = _twins(bits, flat)
    opt, params = walk(opt, params)
    if quantized(bits):
        assert isinstance(opt.state[params[0]]["exp_avg"], storage.QuantizedState)
    kernel = cpu_kernels.available() is None
    for step in range(3, 6):
        _grads(params, step)
        _grads(twin_params, step)
        with record_paths() as paths:
            opt.step()
        with record_paths() as twin_paths:
            twin.step()
        assert paths == twin_paths
        if kernel and bits != 32:  # the fused level's kernel still takes the stored state as it is
            assert "cpu_kernel" in paths
        _assert_twins(opt, params, twin, twin_params)
    for p in params:
        for v in opt.state[p].values():
            if isinstance(v, (Tensor, storage.QuantizedState)):
                assert v.device == p.device


# --- the trainers themselves ----------------------------------------------------------------------------------

def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, 80, generator=g), torch.randn(4, 48, generator=g)


def _linear():
    torch.manual_seed(0)
    return torch.nn.Linear(80, 48)  # its weight quantized at 8/4 bits, its bias kept plain


@pytest.mark.parametrize("bits", BITS)
def test_lightning_fit_then_resume_from_its_checkpoint_equals_a_straight_fit(bits, tmp_path):
    """Lightning moves the optimizer's state to the CPU at the end of every fit() and to the model's device
    when it resumes, both with ``_optimizer_to_device``."""
    L = pytest.importorskip("lightning", reason="lightning is not installed")

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _linear()

        def training_step(self, batch, index):
            x, y = batch
            return (self.net(x) - y).square().mean()

        def configure_optimizers(self):
            return fastoptim.AdamW(self.parameters(), state_bits=bits, **KW)

    def fit(steps, module, ckpt_path=None):
        trainer = L.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*_batch()), batch_size=4)  # a step an epoch
        trainer.fit(module, loader, ckpt_path=ckpt_path)
        return trainer

    first = fit(2, Module())
    first.save_checkpoint(tmp_path / "two.ckpt")
    resumed_module, straight_module = Module(), Module()
    resumed = fit(4, resumed_module, ckpt_path=tmp_path / "two.ckpt")
    straight = fit(4, straight_module)
    _assert_twins(resumed.optimizers[0], list(resumed_module.parameters()),
                  straight.optimizers[0], list(straight_module.parameters()))


@pytest.mark.parametrize("bits", BITS)
def test_accelerate_prepare_save_state_load_state_resumes_as_a_straight_run(bits, tmp_path):
    pytest.importorskip("accelerate", reason="accelerate is not installed")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    x, y = _batch()

    def prepared():
        accelerator = Accelerator(cpu=True)
        net = _linear()
        return (accelerator, *accelerator.prepare(net, fastoptim.AdamW(net.parameters(), state_bits=bits, **KW)))

    def run(accelerator, net, opt, steps):
        for _ in range(steps):
            opt.zero_grad()
            accelerator.backward((net(x) - y).square().mean())
            opt.step()

    try:
        accelerator, net, opt = prepared()
        run(accelerator, net, opt, 2)
        accelerator.save_state(tmp_path)
        run(accelerator, net, opt, 2)
        accelerator, resumed_net, resumed = prepared()
        accelerator.load_state(tmp_path)
        run(accelerator, resumed_net, resumed, 2)
    finally:
        AcceleratorState._reset_state(True)
    _assert_twins(resumed.optimizer, list(resumed_net.parameters()), opt.optimizer, list(net.parameters()))


# --- DCP's state dict functions, on one process -------------------------------------------------------------

@pytest.mark.parametrize("bits,flat", [(b, f) for b in BITS for f in (False, True)])
def test_dcp_optimizer_state_dict_round_trips_on_one_process(bits, flat):
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(80, 48), torch.nn.Linear(48, 3))

    def grads(net, step):
        torch.manual_seed(100 + step)
        net(torch.randn(4, 80)).square().sum().backward()

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        nets = [model(), model()]
        opts = [fastoptim.AdamW(net.parameters(), state_bits=bits, flat=flat, **KW) for net in nets]
        for step in range(3):
            for net, opt in zip(nets, opts):
                opt.zero_grad()
                grads(net, step)
                opt.step()
        saved = get_optimizer_state_dict(nets[0], opts[0])
        resumed = model()
        resumed.load_state_dict(nets[0].state_dict())
        opt = fastoptim.AdamW(resumed.parameters(), state_bits=bits, flat=flat, **KW)
        set_optimizer_state_dict(resumed, opt, saved)
        for step in range(3, 6):
            for net, o in ((resumed, opt), (nets[1], opts[1])):
                o.zero_grad()
                grads(net, step)
                o.step()
        _assert_twins(opt, list(resumed.parameters()), opts[1], list(nets[1].parameters()))
    finally:
        dist.destroy_process_group()


# --- what a quantized state does when it is walked ----------------------------------------------------------

def _quantized(bits=8):
    opt = fastoptim.AdamW(_params(), state_bits=bits, **KW)
    params = [p for p in opt.param_groups[0]["params"]]
    _run(opt, params, 1, 0)
    return opt, params, opt.state[params[0]]["exp_avg"]


def test_a_quantized_state_moves_as_a_tensor_moves():
    _, _, state = _quantized()
    assert state.to("cpu") is state and state.cpu() is state  # already there: itself, as Tensor.to gives
    assert state.to(torch.device("cpu"), non_blocking=True) is state
    moved = state.to("cpu", copy=True)
    assert moved is not state and moved.fmt == state.fmt and moved.shape == state.shape
    assert moved.codes.data_ptr() != state.codes.data_ptr()
    assert torch.equal(moved.codes, state.codes) and torch.equal(moved.absmax, state.absmax)
    with pytest.raises(TypeError, match="keep their dtypes"):
        state.to(torch.float16)
    with pytest.raises(TypeError, match="keep their dtypes"):
        state.to("cpu", torch.float32)


def test_a_state_a_step_holds_refuses_its_fields_reassigned_and_a_copy_takes_them():
    opt, params, state = _quantized()
    with pytest.raises(AttributeError, match="put a new state into optimizer.state"):
        state.codes = state.codes.clone()
    edited = copy.copy(state)
    edited.codes = state.codes.clone()  # a copy is the user's to edit until a step takes it
    edited.absmax = state.absmax.clone()
    opt.state[params[0]]["exp_avg"] = edited
    _run(opt, params, 1, 1)
    assert opt.state[params[0]]["exp_avg"] is edited
    with pytest.raises(AttributeError):
        edited.absmax = state.absmax


def test_a_walk_that_casts_every_tensor_is_refused_at_the_next_step_and_nothing_changes():
    apply_func = pytest.importorskip("lightning_utilities.core.apply_func",
                                     reason="lightning_utilities is not installed")
    opt, params, _ = _quantized()
    state = opt.state[params[0]]
    state["exp_avg"] = apply_func.apply_to_collection(state["exp_avg"], Tensor, lambda t: t.half())
    before = [p.detach().clone() for p in params]
    _grads(params, 1)
    with pytest.raises(ValueError, match=r"state 'exp_avg' of param 0 .*needs uint8 codes"):
        opt.step()
    for p, b in zip(params, before):
        assert torch.equal(p, b)


def test_a_quantized_state_on_another_device_than_its_param_is_moved_there_at_the_next_step():
    """This machine has one device with memory; the meta device stands for the other: the step runs there
    (on no data), and the state found on the CPU is moved to the param's device with its format."""
    p = torch.nn.Parameter(torch.empty(48, 80, device="meta"))
    opt = fastoptim.AdamW([p], state_bits=8, **KW)
    p.grad = torch.empty(48, 80, device="meta")
    opt.step()
    on_cpu = storage.QuantizedState.of(torch.randn(48, 80), storage.Format(8))
    opt.state[p]["exp_avg"] = on_cpu
    opt.step()
    moved = opt.state[p]["exp_avg"]
    assert moved.device.type == "meta" and moved.fmt == on_cpu.fmt and moved.shape == on_cpu.shape
    assert opt.state[p]["step"] == 2
    # a bf16 (16-bit) or plain tensor there is refused, as torch.optim's step refuses it, and nothing changes
    opt16 = fastoptim.AdamW([p], state_bits=16, **KW)
    opt16.step()
    opt16.state[p]["exp_avg"] = torch.zeros(48, 80, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="device cpu; the param has shape .* device meta"):
        opt16.step()
    assert opt16.state[p]["step"] == 1


@pytest.mark.parametrize("bits", BITS)
def test_states_follow_their_params_to_another_device_as_lightning_resumes(bits):
    """Lightning's resume: the model is moved to its device, then ``_optimizer_to_device`` moves the state after
    it (the meta device stands for the other device here)."""
    pytest.importorskip("lightning", reason="lightning is not installed")
    from lightning.fabric.utilities.optimizer import _optimizer_to_device

    params = _params()
    opt = fastoptim.AdamW(params, state_bits=bits, **KW)
    _run(opt, params, 1, 0)
    for p in params:  # (as module.to() moves params where torch.__future__ says to swap them)
        torch.utils.swap_tensors(p, torch.nn.Parameter(torch.empty_like(p, device="meta")))
        p.grad = torch.empty_like(p)
    _optimizer_to_device(opt, torch.device("meta"))
    opt.step()
    for p in params:
        assert opt.state[p]["step"] == 2
        assert all(v.device == p.device for k, v in opt.state[p].items() if k != "step")


def test_a_cpu_checkpoint_loaded_for_params_on_another_device_is_put_there():
    params = _params()
    opt = fastoptim.AdamW(params, state_bits=8, **KW)
    _run(opt, params, 1, 0)
    on_meta = [torch.nn.Parameter(torch.empty_like(p, device="meta")) for p in params]
    resumed = fastoptim.AdamW(on_meta, state_bits=8, **KW)
    resumed.load_state_dict(opt.state_dict())
    for p in on_meta:
        p.grad = torch.empty_like(p)
    resumed.step()
    assert isinstance(resumed.state[on_meta[0]]["exp_avg"], storage.QuantizedState)
    for p in on_meta:
        assert resumed.state[p]["step"] == 2
        assert all(v.device == p.device for k, v in resumed.state[p].items() if k != "step")


def test_the_walked_state_map_is_the_optimizers_own_and_counts_its_changes():
    """A walk rebuilds ``optimizer.state`` as ``type(state)(...)``: the result is a StateMap whose per-param
    dicts it owns (so the step plan is reused again), holding every entry."""
    pytest.importorskip("lightning_utilities", reason="lightning_utilities is not installed")
    from lightning_utilities.core.apply_func import apply_to_collection

    opt, params, _ = _quantized()
    walked = apply_to_collection(opt.state, Tensor, _move)
    assert type(walked) is type(opt.state)
    assert all(walked.tracks(s) for s in walked.values())
    assert {id(p) for p in walked} == {id(p) for p in opt.state}
    assert all(s.keys() == opt.state[p].keys() for p, s in walked.items())
    opt.state = walked
    _run(opt, params, 2, 1)
    plan = opt._stepper.plans[0]
    version = walked.version
    _run(opt, params, 1, 3)
    assert opt._stepper.plans[0] is plan and walked.version == version  # reused: nothing changed since
