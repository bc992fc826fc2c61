"""Rules with per-tensor stages (Muon, Adafactor): the batched paths run, match their oracles, and Muon's recipe
(AdamW groups in the same optimizer) works with schedules, clipping, GradScaler and checkpoints."""

import copy
import warnings

import pytest
import torch

import fastoptim
from conftest import MUON_BF16_ATOL
from fastoptim.levels import record_paths
from fastoptim.levels import LEVELS
from fastoptim.reference import ReferenceMuon
from fastoptim.rules import muon as muon_rule

SHAPES = [(8, 5), (5, 8), (8, 5), (16, 16), (8, 5), (3, 12)]


def _matrices(seed=0, dtype=torch.float32, shapes=SHAPES):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]


def _clone(ps):
    return [torch.nn.Parameter(p.detach().clone()) for p in ps]


def _grads(step, *param_sets, scale=1.0):
    g = torch.Generator().manual_seed(100 + step)
    for i, ref in enumerate(param_sets[0]):
        grad = torch.randn(ref.shape, generator=g) * scale
        for ps in param_sets:
            ps[i].grad = grad.to(ps[i].dtype).clone()


@pytest.mark.parametrize("level", ["foreach", "fused", "compiled"])
def test_newton_schulz_runs_once_per_shape_group(level, monkeypatch):
    """The batched levels orthogonalise each shape group in one call (tall and wide matrices apart), and say
    which path ran; the loop level calls it once per matrix."""
    calls = []
    real = muon_rule.newton_schulz

    def counting(x, *args):
        calls.append(tuple(x.shape))
        return real(x, *args)

    monkeypatch.setattr(muon_rule, "newton_schulz", counting)
    ps = _matrices()
    opt = fastoptim.Muon(ps, lr=0.02, impl=level)
    _grads(1, ps)
    with record_paths() as paths:
        opt.step()
    expected = "stage_compiled" if level == "compiled" else "stage_batched"
    assert expected in paths
    if level != "compiled":  # (compiled: traced once, the count is of traces)
        assert sorted(calls) == sorted([(3, 8, 5), (1, 5, 8), (1, 16, 16), (1, 3, 12)])
    calls.clear()
    loop = fastoptim.Muon(_matrices(), lr=0.02, impl="loop")
    _grads(1, loop.param_groups[0]["params"])
    with record_paths() as paths:
        loop.step()
    assert "stage_loop" in paths and len(calls) == len(SHAPES)


@pytest.mark.parametrize("level", LEVELS)
def test_muon_bf16_newton_schulz_tracks_torch_muon(level):
    """torch.optim.Muon runs Newton-Schulz in bf16. Ours with ns_dtype="bfloat16" runs the same operations
    (``baddbmm``, torch's ``addmm`` batched; kept eager at the compiled level too): within 1e-5 of it after 10
    steps at lr 0.02 at every level. Ours in fp32 is within 5e-3 (a step moves params of size ~1 by ~0.02, bf16
    keeps 8 bits): the same math, bf16's rounding apart."""
    ours_p = _matrices()
    ref_p = _clone(ours_p)
    ours = fastoptim.Muon(ours_p, lr=0.02, impl=level, ns_dtype="bfloat16")
    ref = torch.optim.Muon(ref_p, lr=0.02)
    for step in range(1, 11):
        _grads(step, ours_p, ref_p)
        ours.step()
        ref.step()
    for a, b in zip(ours_p, ref_p):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    fp32_p = _clone(_matrices())
    fp32 = fastoptim.Muon(fp32_p, lr=0.02, impl=level, ns_dtype="float32")
    for step in range(1, 11):
        _grads(step, fp32_p)
        fp32.step()
    for a, b in zip(fp32_p, ref_p):
        torch.testing.assert_close(a, b, atol=5e-3, rtol=0)
        assert not torch.allclose(a, b, atol=1e-5, rtol=0)  # (it is another precision)


@pytest.mark.parametrize("avx512_bf16,amx,mkldnn_bf16,expected", [
    (True, False, True, torch.bfloat16),    # AVX512-BF16 (Zen 4, Cooper Lake): native bf16 dot products
    (False, True, True, torch.bfloat16),    # AMX (Sapphire Rapids)
    (False, False, True, torch.float32),    # AVX-512 without them (Skylake-X): oneDNN emulates bf16, slower than fp32
    (True, False, False, torch.float32),    # oneDNN held below its bf16 kernels (ONEDNN_MAX_CPU_ISA)
])
def test_newton_schulz_runs_in_bf16_only_where_the_cpu_multiplies_it_natively(avx512_bf16, amx, mkldnn_bf16,
                                                                               expected, monkeypatch):
    from fastoptim.rules import muon as muon_rule
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: mkldnn_bf16)
    muon_rule.fast_matmul_dtype.cache_clear()
    try:
        assert muon_rule.fast_matmul_dtype("cpu") == expected
        assert muon_rule.fast_matmul_dtype("cuda") == torch.bfloat16
    finally:
        monkeypatch.undo()
        muon_rule.fast_matmul_dtype.cache_clear()


def test_muon_oracle_is_not_trivially_equal():
    """Guard on ReferenceMuon: another ns_steps gives other params (the parity checks can fail)."""
    a_p, b_p = _matrices(), _matrices()
    a, b = ReferenceMuon(a_p, lr=0.02), ReferenceMuon(b_p, lr=0.02, ns_steps=3)
    _grads(1, a_p, b_p)
    a.step()
    b.step()
    assert max((x - y).abs().max().item() for x, y in zip(a_p, b_p)) > 1e-3


def test_compiled_stages_do_not_recompile_when_lr_changes():
    torch._dynamo.reset()
    ps = _matrices()
    opt = fastoptim.Muon(ps, lr=0.02, impl="compiled")
    counts = []
    for step in range(1, 6):
        _grads(step, ps)
        opt.param_groups[0]["lr"] = 0.02 / step
        opt.param_groups[0]["momentum"] = 0.9 + 0.01 * step
        opt.step()
        counts.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert counts[1] == counts[-1], counts


@pytest.mark.parametrize("bad", [(4,), ()])
def test_muon_refuses_params_that_are_not_matrices(bad):  # (3+ dims: tests/rules/test_muon_matrices.py)
    p = torch.nn.Parameter(torch.zeros(bad))
    with pytest.raises(ValueError, match="matrices only"):
        fastoptim.Muon([p])
    fastoptim.Muon([{"params": [p], "use_muon": False}])  # AdamW takes it


def test_muon_refuses_bad_hyper_parameters():  # (complex params: tests/surface/test_drop_in.py)
    for bad in (dict(ns_steps=-1), dict(adjust_lr_fn="other"), dict(ns_coefficients=(1.0, 2.0)),
                dict(ns_dtype="float16"), dict(momentum=-0.5), dict(lr=-1.0)):
        with pytest.raises(ValueError):
            fastoptim.Muon(_matrices(), **bad)


def test_adafactor_refuses_flat_mode():  # (complex params: tests/surface/test_drop_in.py)
    with pytest.raises(ValueError, match="flat=True"):
        fastoptim.Adafactor(_matrices(), flat=True)


@pytest.mark.parametrize("level", LEVELS)
def test_muon_flat_mode_steps_as_without_it(level):
    a_p = _matrices()
    b_p = _clone(a_p)
    a = fastoptim.Muon(a_p, lr=0.02, impl=level)
    b = fastoptim.Muon(b_p, lr=0.02, impl=level, flat=True)
    for step in range(1, 6):
        _grads(step, a_p, b_p)
        a.step()
        b.step()
    for x, y in zip(a_p, b_p):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-5)


class _TinyLM(torch.nn.Module):
    def __init__(self, vocab=17, width=12):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.hidden = torch.nn.Linear(width, width * 2)
        self.proj = torch.nn.Linear(width * 2, width, bias=False)
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab, bias=False)

    def forward(self, x):
        h = self.embed(x)
        h = h + self.proj(torch.relu(self.hidden(h)))
        return self.head(self.norm(h))


def test_create_muon_builds_the_recipe_in_one_optimizer():
    model = _TinyLM()
    opt = fastoptim.create(model, "muon", lr=0.02, adamw_lr=1e-3, weight_decay=0.05)
    groups = opt.param_groups
    muon = [g for g in groups if g["use_muon"]]
    adamw = [g for g in groups if not g["use_muon"]]
    assert [p for g in muon for p in g["params"]] == [model.hidden.weight, model.proj.weight]
    apart = {id(p) for g in adamw for p in g["params"]}
    assert apart == {id(p) for p in (model.embed.weight, model.head.weight, model.hidden.bias, model.norm.weight,
                                     model.norm.bias)}
    assert all(g["lr"] == 1e-3 and g["betas"] == (0.9, 0.95) for g in adamw)
    assert [g["weight_decay"] for g in groups] == [0.05, 0.05, 0.0]


@pytest.mark.parametrize("tied", [True, False])
def test_muon_recipe_keeps_hidden_matrices_as_wide_as_the_vocabulary_on_muon(tied):
    """A GPT whose width equals its vocabulary (256 bytes): attn.proj and mlp.down are (256, ...) matrices like
    the head, yet only the embedding and the head (tied or the last such Linear) go to AdamW."""
    from fastoptim.train.model import GPT, GPTConfig
    model = GPT(GPTConfig(vocab_size=256, n_embd=256, n_layer=2, n_head=4, n_kv_head=2, block_size=16))
    if not tied:
        model.head.weight = torch.nn.Parameter(model.embed.weight.detach().clone())
    groups = fastoptim.factory.muon_groups(model)
    muon = {id(p) for g in groups if g.get("use_muon", True) for p in g["params"]}
    adamw = {id(p) for g in groups if g.get("use_muon", True) is False for p in g["params"]}
    hidden = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not model.head]
    assert len(hidden) == 8 and muon == {id(p) for p in hidden}
    assert {id(model.embed.weight), id(model.head.weight)} <= adamw
    assert all(p.dim() < 2 or id(p) in (id(model.embed.weight), id(model.head.weight))
               for g in groups if g.get("use_muon", True) is False for p in g["params"])


@pytest.mark.parametrize("level", LEVELS)
def test_muon_recipe_matches_muon_and_adamw_oracles_with_schedule_and_clipping(level):
    """One optimizer, two algorithms: the Muon groups match ReferenceMuon and the AdamW groups torch's AdamW,
    with a schedule moving both groups' lr and the global grad norm clipped across both, every step; a
    state_dict round trip continues identically."""
    torch.manual_seed(0)
    model = _TinyLM()
    ref_model = _TinyLM()
    ref_model.load_state_dict(model.state_dict())
    opt = fastoptim.create(model, "muon", lr=0.02, adamw_lr=1e-2, impl=level, max_grad_norm=0.5)
    ref_groups = fastoptim.factory.muon_groups(ref_model, adamw_lr=1e-2)
    ref_muon = ReferenceMuon([g for g in ref_groups if g.get("use_muon", True)][0]["params"], lr=0.02)
    ref_adamw = [torch.optim.AdamW([p for g in ref_groups if g.get("use_muon", True) is False for p in g["params"]
                                    if p.dim() >= 2], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, foreach=False),
                 torch.optim.AdamW([p for g in ref_groups if g.get("use_muon", True) is False for p in g["params"]
                                    if p.dim() < 2], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0, foreach=False)]
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    ref_scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in [ref_muon, *ref_adamw]]
    x = torch.randint(0, 17, (4, 6))
    for step in range(6):
        for m in (model, ref_model):
            m.zero_grad()
            m(x).square().mean().backward()
        torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.5)
        opt.step()
        sched.step()
        for o, s in zip([ref_muon, *ref_adamw], ref_scheds):
            o.step()
            s.step()
        for (name, a), b in zip(model.named_parameters(), ref_model.parameters()):
            torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5, msg=lambda m: f"step {step}, {name}: {m}")
    saved = opt.state_dict()
    again = fastoptim.create(_TinyLM(), "muon", lr=0.02, adamw_lr=1e-2, impl=level, max_grad_norm=0.5)
    copy = _TinyLM()
    copy.load_state_dict(model.state_dict())
    again = fastoptim.create(copy, "muon", lr=0.02, adamw_lr=1e-2, impl=level, max_grad_norm=0.5)
    again.load_state_dict(saved)
    for m in (model, copy):
        m.zero_grad()
        m(x).square().mean().backward()
    opt.step()
    again.step()
    for a, b in zip(model.parameters(), copy.parameters()):
        assert torch.equal(a, b)
    assert "momentum_buffer" in opt.state[model.hidden.weight] and "step" not in opt.state[model.hidden.weight]
    assert "exp_avg" in opt.state[model.head.weight] and opt.state[model.head.weight]["step"] == 7


def test_muon_recipe_under_grad_scaler_skips_inf_steps_in_both_algorithms():
    model = _TinyLM()
    opt = fastoptim.create(model, "muon", lr=0.02, adamw_lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    x = torch.randint(0, 17, (4, 6))
    scaler.scale(model(x).square().mean()).backward()
    scaler.step(opt)
    scaler.update()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    state_before = {p: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
                    for p, s in opt.state.items()}
    model.zero_grad()
    scaler.scale(model(x).square().mean()).backward()
    model.hidden.weight.grad[0, 0] = float("inf")
    scaler.step(opt)
    scaler.update()
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    assert opt.state[model.head.weight]["step"] == state_before[model.head.weight]["step"] == 1
    assert "momentum_buffer" in state_before[model.hidden.weight]
    for p, saved in state_before.items():  # Muon's momentum and AdamW's moments as they were
        assert opt.state[p].keys() == saved.keys()
        for k, v in saved.items():
            assert torch.equal(opt.state[p][k], v) if torch.is_tensor(v) else opt.state[p][k] == v, k


@pytest.mark.sample("name", "level")
@pytest.mark.parametrize("name", ["muon", "adafactor"])
@pytest.mark.parametrize("level", LEVELS)
def test_bf16_params_step_close_to_fp32(name, level):
    """bf16 params with state in bf16 (as torch keeps it): within bf16's rounding of the fp32 run after 5 steps
    (stated: 1e-2 absolute plus 1e-2 relative; a step moves params by ~lr = 1e-2, bf16's relative spacing is
    2^-8 and each step rounds once more)."""
    cls = getattr(fastoptim, {"muon": "Muon", "adafactor": "Adafactor"}[name])
    a_p = _matrices()
    b_p = [torch.nn.Parameter(p.detach().to(torch.bfloat16)) for p in a_p]
    a = cls(a_p, lr=1e-2, impl=level)
    b = cls(b_p, lr=1e-2, impl=level)
    for step in range(1, 6):
        _grads(step, a_p, b_p)
        a.step()
        b.step()
    for x, y in zip(a_p, b_p):
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y.float(), x, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("bits", [16, 8])
def test_muon_low_bit_momentum_is_kept_and_close(bits):
    shapes = [(64, 80), (80, 64)]
    a_p = _matrices(shapes=shapes)
    b_p = _clone(a_p)
    a = fastoptim.Muon(a_p, lr=0.02)
    b = fastoptim.Muon(b_p, lr=0.02, state_bits=bits, min_quant_size=1024)
    for step in range(1, 6):
        _grads(step, a_p, b_p)
        a.step()
        b.step()
    buf = b.state[b_p[0]]["momentum_buffer"]
    assert (buf.dtype == torch.bfloat16) if bits == 16 else type(buf).__name__ == "QuantizedState"
    for x, y in zip(a_p, b_p):
        torch.testing.assert_close(y, x, atol=2e-2 if bits == 8 else 5e-3, rtol=0)


def test_muon_state_dict_loads_into_torch_muon():
    ps = _matrices()
    ours = fastoptim.Muon(ps, lr=0.02)
    _grads(1, ps)
    ours.step()
    ref = torch.optim.Muon(_clone(ps), lr=0.02)
    ref.load_state_dict(ours.torch_state_dict())
    for p, q in zip(ps, ref.param_groups[0]["params"]):
        assert torch.equal(ref.state[q]["momentum_buffer"], ours.state[p]["momentum_buffer"])
    # and torch's into ours
    back = fastoptim.Muon(_clone(ps), lr=0.02)
    back.load_state_dict(ref.state_dict())
    assert torch.equal(back.state[back.param_groups[0]["params"][0]]["momentum_buffer"],
                       ours.state[ps[0]]["momentum_buffer"])


def test_torch_state_dict_spells_a_constant_schedule_as_torch_muon_takes_it():
    """torch.optim.Muon takes one (a, b, c): a preset's name or a list of triples in ``state_dict()`` would load
    into it and fail its first step. ``torch_state_dict()`` gives a constant schedule as its triple (the group's
    own stays as it was); one that changes per iteration has no such form and stays as it is."""
    for coefficients in ("keller", [(3.0, -3.2, 1.2)] * 2):
        ps = _matrices()
        ours = fastoptim.Muon(ps, lr=0.02, ns_coefficients=coefficients, ns_dtype="bfloat16")
        _grads(1, ps)
        ours.step()
        ref = torch.optim.Muon(_clone(ps), lr=0.02)
        ref.load_state_dict(copy.deepcopy(ours.torch_state_dict()))  # (as read back: no state shared)
        assert ours.param_groups[0]["ns_coefficients"] == coefficients
        triple = muon_rule.ns.schedule(coefficients, 1)[0]
        assert ref.param_groups[0]["ns_coefficients"] == triple
        _grads(2, ps, ref.param_groups[0]["params"])
        ours.step()
        ref.step()  # (torch's Newton-Schulz in bf16, as ours here)
        for p, q in zip(ps, ref.param_groups[0]["params"]):
            torch.testing.assert_close(q, p, atol=MUON_BF16_ATOL, rtol=0)
    for coefficients in ("polar_express", [(3.0, -3.2, 1.2), (2.0, -1.5, 0.5)]):
        ours = fastoptim.Muon(_matrices(), lr=0.02, ns_coefficients=coefficients)
        assert ours.torch_state_dict()["param_groups"][0]["ns_coefficients"] == coefficients


def test_adafactor_factored_states_have_torchs_shapes_and_load_both_ways():
    ps = [torch.nn.Parameter(torch.randn(s)) for s in [(6, 4), (2, 3, 5), (7,)]]
    ours = fastoptim.Adafactor(ps)
    _grads(1, ps)
    ours.step()
    ref = torch.optim.Adafactor(_clone(ps), foreach=False)
    ref.load_state_dict(copy.deepcopy(ours.state_dict()))  # (torch's loader keeps the tensors it is given)
    for p, q in zip(ps, ref.param_groups[0]["params"]):
        assert set(ours.state[p]) == set(ref.state[q])
        for k, v in ref.state[q].items():
            if k != "step":
                assert v.shape == ours.state[p][k].shape
    assert ours.state[ps[0]]["row_var"].shape == (6, 1) and ours.state[ps[0]]["col_var"].shape == (1, 4)
    back_p = _clone(ps)
    back = fastoptim.Adafactor(back_p)
    back.load_state_dict(copy.deepcopy(ref.state_dict()))  # and back again: all three continue as one
    ref_p = ref.param_groups[0]["params"]
    for step in range(2, 5):
        _grads(step, ps, ref_p, back_p)
        for opt in (ours, ref, back):
            opt.step()
    for a, b, c in zip(ps, ref_p, back_p):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
        assert torch.equal(a, c)
    bad = ref.state_dict()
    bad["state"][0]["row_var"] = torch.zeros(6, 4)
    with pytest.raises(ValueError, match="row_var"):
        fastoptim.Adafactor(_clone(ps)).load_state_dict(bad)


@pytest.mark.sample("level", "rounding")
@pytest.mark.parametrize("rounding", ["nearest", "stochastic", "kahan"])
@pytest.mark.parametrize("level", LEVELS)
def test_adafactor_default_eps1_is_the_stored_param_dtypes(level, rounding):
    """eps1=None means the param dtype's epsilon (torch: finfo(param.dtype).eps), also where bf16 params step
    in fp32 to be rounded stochastically or with Kahan. With grads below bf16's epsilon the first step moves
    each param by ~13% of itself with bf16's epsilon and by ~100% with fp32's."""
    g = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=g).to(torch.bfloat16) for s in [(6, 4), (10,)]]
    grads = [(torch.randn(p.shape, generator=g) * 1e-3).to(torch.bfloat16) for p in start]
    params = [torch.nn.Parameter(p.clone()) for p in start]
    opt = fastoptim.Adafactor(params, lr=1.0, impl=level, rounding=rounding)
    ref = [torch.nn.Parameter(p.float()) for p in start]
    oracle = torch.optim.Adafactor(ref, lr=1.0, eps=(torch.finfo(torch.bfloat16).eps, 1e-3), foreach=False)
    for p, r, grad in zip(params, ref, grads):
        p.grad, r.grad = grad.clone(), grad.float()
    opt.step()
    oracle.step()
    for ours, theirs, before in zip(params, ref, start):
        moved = (theirs.detach() - before.float()).abs() / before.float().abs()
        assert 0.01 < moved.median() < 0.5  # bf16's epsilon scaled the update down, and bf16 resolves it
        torch.testing.assert_close(ours.float(), theirs.detach(), rtol=2 ** -6, atol=0)


@pytest.mark.parametrize("level", LEVELS)
def test_muon_maximize_steps_on_the_negated_gradient(level):
    a_p = _matrices()
    b_p = _clone(a_p)
    a = fastoptim.Muon(a_p, lr=0.02, impl=level, maximize=True)
    b = fastoptim.Muon(b_p, lr=0.02, impl=level)
    for step in range(1, 4):
        _grads(step, a_p, b_p)
        for p in b_p:
            p.grad.neg_()
        a.step()
        b.step()
    for x, y in zip(a_p, b_p):
        assert torch.equal(x, y)
    with pytest.raises(TypeError, match="maximize"):
        fastoptim.Muon(_matrices(), maximize=1)


def test_muon_adamw_groups_get_betas_that_defaults_do_not_list():
    """``defaults`` lists torch.optim.Muon's keys (schedulers read it); a use_muon=False group still gets the
    constructor's betas and amsgrad, also when added later, after a deepcopy and after loading a checkpoint
    that lacks them (torch.optim.Muon's), which keeps this optimizer's own use_muon and ns_dtype."""
    opt = fastoptim.Muon(_matrices()[:2], lr=0.02, betas=(0.8, 0.9), ns_dtype="float32")
    assert "betas" not in opt.defaults and "amsgrad" not in opt.defaults and "momentum" in opt.defaults
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))], "use_muon": False})
    assert opt.param_groups[1]["betas"] == (0.8, 0.9) and opt.param_groups[1]["amsgrad"] is False
    again = copy.deepcopy(opt)
    again.add_param_group({"params": [torch.nn.Parameter(torch.zeros(4))], "use_muon": False})
    assert again.param_groups[2]["betas"] == (0.8, 0.9)
    theirs = torch.optim.Muon(_matrices()[:2], lr=0.01)
    mats = _matrices()[:2]
    ours = fastoptim.Muon(mats, lr=0.02, ns_dtype="float32")
    ours.load_state_dict(theirs.state_dict())
    assert ours.param_groups[0]["lr"] == 0.01 and ours.param_groups[0]["ns_dtype"] == "float32"
    assert ours.param_groups[0]["use_muon"] is True


@pytest.mark.parametrize("level", LEVELS)
def test_muon_steps_empty_matrices_of_every_kind(level):
    """(0, 0), (5, 0) and (0, 5) matrices step as no-ops beside a real one (torch's lr ratio divides by cols)."""
    params = [torch.nn.Parameter(torch.zeros(s)) for s in [(0, 0), (5, 0), (0, 5)]] + _matrices()[:1]
    ref_p = _clone(params[-1:])
    opt = fastoptim.Muon(params, lr=0.02, impl=level, ns_dtype="float32")
    ref = ReferenceMuon(ref_p, lr=0.02, ns_dtype="float32")
    for step in range(1, 3):
        _grads(step, params)
        ref_p[0].grad = params[-1].grad.clone()
        opt.step()
        ref.step()
    torch.testing.assert_close(params[-1], ref_p[0], atol=1e-6, rtol=1e-5)
    assert [tuple(opt.state[p]["momentum_buffer"].shape) for p in params[:3]] == [(0, 0), (5, 0), (0, 5)]


class _Encoder(torch.nn.Module):
    """Token and positional tables; MLPs as wide as the positional table (128); heads registered first."""

    def __init__(self, heads=0, head_name="heads"):
        super().__init__()
        if heads:
            self.add_module(head_name, torch.nn.ModuleList(torch.nn.Linear(32, 100, bias=False) for _ in range(heads)))
        self.tok = torch.nn.Embedding(100, 32)
        self.pos = torch.nn.Embedding(128, 32)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(32, 128) for _ in range(2))


def _on_adamw(groups):
    return {id(p) for g in groups if g.get("use_muon", True) is False for p in g["params"]}


def test_muon_recipe_head_rule_on_models_with_several_wide_linears():
    """Untied heads registered before the blocks and multi-token heads go to AdamW (named like heads); a model
    whose only wide Linears are hidden ones keeps them all on Muon and says so; head= overrides the rule."""
    model = _Encoder(heads=3)
    adamw = _on_adamw(fastoptim.factory.muon_groups(model))
    assert {id(h.weight) for h in model.heads} <= adamw
    assert not {id(b.weight) for b in model.blocks} & adamw
    one = _Encoder(heads=1, head_name="proj_out")  # one Linear as wide as the vocabulary: the head, whatever its name
    one.blocks = torch.nn.ModuleList(torch.nn.Linear(32, 64) for _ in range(2))
    assert id(one.proj_out[0].weight) in _on_adamw(fastoptim.factory.muon_groups(one))
    encoder = _Encoder()
    with pytest.warns(UserWarning, match="none is named like an output head"):
        adamw = _on_adamw(fastoptim.factory.muon_groups(encoder))
    assert adamw == {id(encoder.tok.weight), id(encoder.pos.weight)} | {id(b.bias) for b in encoder.blocks}
    chosen = _on_adamw(fastoptim.factory.muon_groups(encoder, head=encoder.blocks[1]))
    assert id(encoder.blocks[1].weight) in chosen and id(encoder.blocks[0].weight) not in chosen
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = fastoptim.create(encoder, "muon", head=())  # none, and no warning
    assert _on_adamw(opt.param_groups) == adamw


def test_muon_pickled_with_betas_in_defaults_moves_them_to_group_defaults():
    """An optimizer pickled before ``group_only`` existed (its defaults held betas and amsgrad) restores with
    the constructor's values for new AdamW groups, and schedulers then cycle Muon's momentum."""
    opt = fastoptim.Muon(_matrices()[:1], lr=0.02, betas=(0.8, 0.99), amsgrad=True)
    state = opt.__getstate__()
    state["defaults"] = {**state["defaults"], "betas": (0.8, 0.99), "amsgrad": True}
    del state["_group_defaults"]
    old = fastoptim.Muon.__new__(fastoptim.Muon)
    old.__setstate__(state)
    old.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))], "use_muon": False})
    assert old.param_groups[-1]["betas"] == (0.8, 0.99) and old.param_groups[-1]["amsgrad"] is True
    assert "betas" not in old.defaults
    assert not torch.optim.lr_scheduler.OneCycleLR(old, max_lr=0.1, total_steps=10).use_beta1


def test_named_params_are_checked_as_their_tensors_and_refused_states_name_the_algorithm():
    with pytest.raises(ValueError, match="matrices only"):
        fastoptim.Muon([("v", torch.nn.Parameter(torch.zeros(5)))])
    named = fastoptim.Muon([("w", torch.nn.Parameter(torch.zeros(3, 4)))], flat=True)
    assert named.param_groups[0]["param_names"] == ["w"]
    theirs = torch.optim.Muon(_matrices()[:1])
    _grads(1, theirs.param_groups[0]["params"])
    theirs.step()
    ours = fastoptim.Muon([{"params": _matrices()[:1], "use_muon": False}])
    before = copy.deepcopy(ours.state_dict())
    with pytest.raises(ValueError, match="'momentum_buffer' for param 0, which its group's algorithm \\(adamw\\)"):
        ours.load_state_dict(theirs.state_dict())
    assert ours.state_dict() == before


@pytest.mark.parametrize("level", ["loop", "fused"])
def test_adafactor_bf16_factored_states_are_torchs_exactly(level):
    """torch takes each factor from the grad's norm in the param's dtype, squared there; ours sums fp32 squares
    (faster) and rounds the norm the same way: bf16 row and column states equal torch's (foreach=False)."""
    g = torch.Generator().manual_seed(1)
    init = [torch.randn(s, generator=g).bfloat16() for s in ((17, 33), (64, 300), (5, 3, 7))]
    ours = [torch.nn.Parameter(x.clone()) for x in init]
    ref = [torch.nn.Parameter(x.clone()) for x in init]
    opt, topt = fastoptim.Adafactor(ours, impl=level), torch.optim.Adafactor(ref, foreach=False)
    for _ in range(5):
        for p, q in zip(ours, ref):
            p.grad = torch.randn(p.shape, generator=g).bfloat16()
            q.grad = p.grad.clone()
        opt.step()
        topt.step()
    for p, q in zip(ours, ref):
        for name in ("row_var", "col_var"):
            assert torch.equal(opt.state[p][name], topt.state[q][name]), name


@pytest.mark.parametrize("level", ["loop", "foreach", "fused"])
def test_adafactor_floor_on_the_variance_estimate_is_torchs(level):
    """Grads so small that g^2 is under eps1^2: the estimate's floor (eps1^2) sets the update. The param's
    change must be torch's to rtol 1e-5 (the params themselves hide it: the change is below their atol)."""
    g = torch.Generator().manual_seed(2)
    init = [torch.randn(s, generator=g) for s in ((16, 24), (40,))]
    ours = [torch.nn.Parameter(x.clone()) for x in init]
    ref = [torch.nn.Parameter(x.clone()) for x in init]
    opt, topt = fastoptim.Adafactor(ours, impl=level), torch.optim.Adafactor(ref, foreach=False)
    for _ in range(3):
        before = [p.detach().clone() for p in ours]
        for p, q in zip(ours, ref):
            p.grad = torch.randn(p.shape, generator=g) * 1e-9
            q.grad = p.grad.clone()
        opt.step()
        topt.step()
        for p, q, b in zip(ours, ref, before):
            torch.testing.assert_close(p.detach() - b, q.detach() - b, rtol=1e-5, atol=0)
            p.data.copy_(q.detach())  # each step from torch's params: the change alone is compared
