"""A model-based test of the whole surface: random user programs run against torch.optim (foreach=False).

Each program builds a fastoptim optimizer (one level, flat or not) and its torch.optim twin over the same
params, then does what users do between steps: steps with fresh grads (some None, some replacing the
flat views), hyper-parameter changes, a cleared state, a replaced state mapping, a replaced state tensor
or step count, a state_dict saved and loaded into a NEW optimizer, add_param_group, zero_grad, and
GradScaler steps with inf grads, the first step included, and backwards that accumulate (after one grad was set
to None by hand, too). After every action the params, their ``.grad``, the per-param state read through
``optimizer.state`` and the whole ``state_dict()`` must agree with torch's.

Flat mode runs the same programs, None grads included: as in torch, a param whose grad is None is not stepped.

With ``gradient_release`` the same programs also run real backwards that step the params they reach inside
backward (per-param buckets or one), against torch stepping exactly those params after the same backward; a
backward under ``accumulating()`` steps nothing, and ``step()`` steps what no backward stepped.

With ``state_bits`` 16, 8 or 4 the same programs run with low-bit state (every matrix quantized), and
torch's twin keeps each of its states rounded as fastoptim's storage keeps it (``_as_stored``): quantizing
dequantized codes gives the same codes, so both sides hold the same values, and every state of a param that
stepped must be kept at its width.

CI runs a bounded number of programs per level; ``FASTOPTIM_STATEFUL_EXAMPLES=2000`` runs many more.
"""

import io
import os
from collections import defaultdict

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, \
    run_state_machine_as_test

from conftest import DEVICES, ELEMENTWISE, FLAT, STORED, assert_state_close, quantized, shapes_for
from fastoptim import storage
from fastoptim.levels import LEVELS, record_paths
from fastoptim.registry import OPTIMIZERS
from fastoptim.reference import reference_class, reference_kwargs

EXAMPLES = int(os.environ.get("FASTOPTIM_STATEFUL_EXAMPLES", "25"))
RELEASE_EXAMPLES = max(EXAMPLES // 2, 5)  # (the release variant's budget in the default run)
SHAPES = [(3, 2), (5,), (1,)]
NEW_SHAPES = [(2, 3), (4,)]
ATOL, RTOL = 1e-5, 1e-4  # a dozen steps of fp32 arithmetic in another order than torch's


def _fresh_state_like_torch_init(ref, spec, params=None):
    """torch's Adagrad makes its state in __init__ only, and fails on a param without one (after a reset,
    or in a group added later). The torch side gets what its __init__ would have made: for an added
    group at once (as fastoptim does), after a reset before its next step for the params that step
    (fastoptim makes it in the step by itself)."""
    if not spec.cls.rule.eager_state:
        return
    for group in ref.param_groups:
        for p in group["params"]:
            wanted = p.grad is not None if params is None else any(p is q for q in params)
            if wanted and not ref.state.get(p):
                ref.state[p] = {"step": torch.tensor(0.0),
                                "sum": torch.full_like(p, group["initial_accumulator_value"])}


class UserProgram(RuleBasedStateMachine):
    level = "loop"          # set per test by a subclass
    expected_path = None    # a path every step must take, where a level promises one
    state_bits = 32         # below 32: torch's twin keeps each state as the storage would (``_as_stored``)
    device = "cpu"          # where params, grads and state live (conftest.DEVICES); draws are made on the CPU
    release = False         # gradient_release=True: backwards step the params they reach (``released_backward``)

    @initialize(name=st.sampled_from(sorted(OPTIMIZERS)), option=st.integers(0, 3), flat=st.booleans(),
                seed=st.integers(0, 2 ** 16), bucket_mb=st.sampled_from([1e-6, None]))
    def build(self, name, option, flat, seed, bucket_mb=None):
        self.spec = spec = OPTIMIZERS[name]
        self.opts = dict(spec.option_sets[option % len(spec.option_sets)])
        if spec.params == "matrices" and self.opts.get("ns_dtype") is None:
            # Muon: these programs test the user's surface, not bf16 Newton-Schulz (tests/surface/test_parity.py,
            # tests/paths/test_stages.py), whose one-spacing differences would outgrow ATOL as lr doubles
            self.opts["ns_dtype"] = "float32"
        # (Adafactor refuses flat=True: its factored states are not param-shaped; gradient_release refuses it:
        # freeing a bucket's grads would free nothing)
        flat = flat and name in FLAT and not self.release
        # release: 1e-6 MB makes each param its own bucket, None one bucket stepped at the end of backward
        self.release_opts = dict(gradient_release=True, release_bucket_mb=bucket_mb) if self.release else {}
        self.retired = []  # (release) optimizers a reload replaced, with their flush counts then: they step nothing
        self.shapes = lambda shapes: shapes_for(name, shapes)  # (Muon: matrices of the same sizes)
        low = {}
        if self.state_bits != 32:  # every matrix is quantized (flat mode: kept apart from the flat buffers)
            low = dict(state_bits=self.state_bits, min_quant_size=0)
            if quantized(self.state_bits) and spec.cls.rule.refuses_quantized_state({**spec.cls.rule.defaults,
                                                                                    **self.opts}):
                self.opts = dict(spec.option_sets[0])  # (centered RMSprop: refused by name, tested apart)
        self.flat, self.low = flat, low
        self.gen = torch.Generator().manual_seed(seed)
        self.ours_p = [torch.nn.Parameter(self._draw(s)) for s in self.shapes(SHAPES)]
        self.ref_p = [torch.nn.Parameter(p.detach().clone()) for p in self.ours_p]
        self.ours = spec.cls(self._groups(self.ours_p), impl=self.level, flat=flat, **low, **self.opts,
                             **self.release_opts)
        self.ref = reference_class(spec)(self._groups(self.ref_p), **self.opts, **reference_kwargs(spec))
        self.scalers = None
        self.added = 0
        self.stepped_in_backward = False  # since the last step() or zero_grad(): another backward would be refused
        self.freed = False  # (release) grads freed since the last zero_grad(): set_to_none=False is refused
        self.defer_check = False
        self.grads_scaled = False  # ours' grads left scaled by a step that unscaled them in its kernel
        self._as_stored()  # (Adagrad makes its state at once)

    def _draw(self, shape, rand=torch.randn):
        """Random values from the program's generator (on the CPU: the same numbers on every device), on the
        program's device."""
        return rand(shape, generator=self.gen).to(self.device)

    def _groups(self, params):
        return [{"params": params[:2]}, {"params": params[2:], "lr": self.opts.get("lr", 1e-3) * 0.5}]

    # --- actions --------------------------------------------------------------------------------------

    def _set_grads(self, data, scale=1.0, inf=False, at_least_one=False):
        n = len(self.ours_p)
        present = data.draw(st.lists(st.booleans(), min_size=n, max_size=n), label="has grad")
        if at_least_one and not any(present):  # torch's GradScaler refuses a step with no grads at all
            present[0] = True
        in_place = self.flat and data.draw(st.booleans(), label="write into the flat grad views")
        self.grads_scaled = False
        for i, (a, b) in enumerate(zip(self.ours_p, self.ref_p)):
            if not present[i]:
                a.grad = b.grad = None
                continue
            g = self._draw(a.shape) * scale
            if inf and i == data.draw(st.integers(0, n - 1), label="inf param"):
                g.view(-1)[0] = float("inf")
            if in_place and a.grad is not None:
                a.grad.copy_(g)
            else:
                a.grad = g.clone()
            b.grad = g.clone()
        return present

    def _step(self, step_ours, step_ref, skipped=False):
        stepping = [b for b in self.ref_p if b.grad is not None]
        with record_paths() as paths:
            step_ours()
        if not skipped:  # (torch's GradScaler does not call a step it skips)
            _fresh_state_like_torch_init(self.ref, self.spec)
            self._fresh_state_stored_alike(stepping)
            self._as_stored(stepping)
        step_ref()
        if not skipped:  # (a skipped step converts nothing: a state put in before it stays as put on both sides)
            self._as_stored(stepping)
            self._check_stored_at_its_width(stepping)
        if self.expected_path and paths:
            assert self.expected_path in paths, paths

    @rule(data=st.data())
    def step(self, data):
        self.stepped_in_backward = False
        self._set_grads(data)
        self._step(self.ours.step, self.ref.step)

    @precondition(lambda self: not self.release)  # (refused with release: its buckets step before the unscale)
    @rule(data=st.data(), inf=st.booleans(), defer=st.booleans())
    def grad_scaler_step(self, data, inf, defer):
        if self.scalers is None:  # growth every 2 good steps: the scale moves both ways
            self.scalers = [torch.amp.GradScaler(self.device, init_scale=2.0 ** 6, growth_interval=2)
                            for _ in range(2)]
            for s in self.scalers:
                s.scale(torch.ones((), device=self.device))
        ours_s, ref_s = self.scalers
        self._set_grads(data, scale=ours_s.get_scale(), inf=inf, at_least_one=True)
        # where the kernels unscale (as torch's fused=True), GradScaler leaves ours' grads scaled
        self.grads_scaled = bool(self.ours._step_supports_amp_scaling)
        # skipped where an inf really went in (the draw may have picked a param without a grad)
        placed = any(bool(b.grad.isinf().any()) for b in self.ref_p if b.grad is not None)
        self._step(lambda: ours_s.step(self.ours), lambda: ref_s.step(self.ref), skipped=placed)
        ours_s.update()
        ref_s.update()
        assert ours_s.get_scale() == ref_s.get_scale()
        # reading state takes a kernel-skipped step back at once; not reading it leaves that to the next step
        self.defer_check = defer

    @rule(group=st.integers(0, 9), lr_factor=st.sampled_from([0.5, 2.0]), weight_decay=st.sampled_from([0.0, 0.05]))
    def change_hyperparameters(self, group, lr_factor, weight_decay):
        group %= len(self.ref.param_groups)
        for opt in (self.ours, self.ref):
            g = opt.param_groups[group]
            g["lr"] = g["lr"] * lr_factor
            g["weight_decay"] = weight_decay

    @rule()
    def clear_state(self):
        self.ours.state.clear()
        self.ref.state.clear()

    @rule()
    def replace_state_mapping(self):
        self.ours.state = defaultdict(dict)
        self.ref.state = defaultdict(dict)

    @rule(data=st.data())
    def replace_a_state_tensor(self, data):
        i = data.draw(st.integers(0, len(self.ref_p) - 1), label="param")
        ref_state = self.ref.state.get(self.ref_p[i])
        names = sorted(k for k, v in (ref_state or {}).items() if k != "step" and isinstance(v, torch.Tensor)
                       and k not in self.spec.cls.rule.host_states)
        if not names:
            return
        name = data.draw(st.sampled_from(names), label="state")
        # the saved state scaled down elementwise: a state that was valid stays so (second moments >= 0, and
        # centered RMSprop's grad_avg**2 <= square_avg, which random values would break: sqrt of < 0 is NaN)
        value = ref_state[name].detach() * (0.5 + 0.5 * self._draw(ref_state[name].shape, torch.rand))
        self.ours.state[self.ours_p[i]][name] = value.clone()
        ref_state[name] = value.clone()  # (as put, on both sides, until the next step converts it)

    @precondition(lambda self: self.spec.cls.rule.exports_step)
    @rule(data=st.data(), step=st.integers(0, 3))
    def rewind_a_step_count(self, data, step):
        i = data.draw(st.integers(0, len(self.ref_p) - 1), label="param")
        ref_state = self.ref.state.get(self.ref_p[i])
        if not ref_state or "step" not in ref_state:
            return
        self.ours.state[self.ours_p[i]]["step"] = step
        ref_state["step"] = torch.tensor(float(step))

    @rule(from_torch=st.booleans())
    def reload_into_a_new_optimizer(self, from_torch):
        self.stepped_in_backward = False
        source = self.ref if from_torch else self.ours
        buffer = io.BytesIO()
        torch.save(source.state_dict(), buffer)
        buffer.seek(0)
        saved = torch.load(buffer)
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(g["params"])}
                  for g in self.ours.param_groups]
        fresh = self.spec.cls(groups, impl=self.level, flat=self.flat, **self.low, **self.opts,
                              **self.release_opts)
        fresh.load_state_dict(saved)
        self._as_stored(quantized_only=True)  # a plain state loaded where the format is quantized converts at once
        if self.release:  # kept alive: the newest optimizer over a param owns its release, the old one steps nothing
            self.retired.append((self.ours, self.ours._release.flushes))
        self.ours = fresh

    @precondition(lambda self: self.added < 2)
    @rule(shape=st.sampled_from(NEW_SHAPES), lr=st.sampled_from([1e-3, 2e-2]))
    def add_param_group(self, shape, lr):
        p = torch.nn.Parameter(self._draw(self.shapes([shape])[0]))
        q = torch.nn.Parameter(p.detach().clone())
        self.ours.add_param_group({"params": [p], "lr": lr})
        self.ref.add_param_group({"params": [q], "lr": lr})
        _fresh_state_like_torch_init(self.ref, self.spec, [q])
        self.ours_p.append(p)
        self.ref_p.append(q)
        self.added += 1
        self._as_stored([q])

    @rule(set_to_none=st.booleans())
    def zero_grad(self, set_to_none):
        refused = ("no opt.step" if self.stepped_in_backward  # (torch.optim would step nothing on those grads)
                   else "set_to_none=False" if self.freed and not set_to_none else None)  # (torch's grads: zeros)
        if refused:
            grads = [a.grad for a in self.ours_p]
            with pytest.raises(RuntimeError, match=refused):
                self.ours.zero_grad(set_to_none=set_to_none)
            assert all(a.grad is g for a, g in zip(self.ours_p, grads)), "a refused zero_grad changed grads"
            return
        self.stepped_in_backward = False
        self.freed = False
        self.grads_scaled = False
        self.ours.zero_grad(set_to_none=set_to_none)
        self.ref.zero_grad(set_to_none=set_to_none)
        for a, b in zip(self.ours_p, self.ref_p):
            assert (a.grad is None) == (b.grad is None)
            if b.grad is not None:
                assert torch.equal(a.grad, b.grad)

    def _draw_backward(self, data):
        """Which params a backward reaches (often all: a whole model's backward), and the weights of its loss
        ``sum((p * w).sum())`` over them."""
        n = len(self.ours_p)
        reached = [True] * n if data.draw(st.booleans(), label="the whole model") else \
            data.draw(st.lists(st.booleans(), min_size=n, max_size=n), label="reached by the backward")
        return reached, [self._draw(p.shape) for p in self.ref_p]

    @staticmethod
    def _backward(params, reached, weights):
        terms = [(p * w).sum() for p, w, r in zip(params, weights, reached) if r]
        if terms:
            sum(terms).backward()

    @rule(data=st.data())
    def accumulate_a_backward(self, data):
        """A backward adds into the grads there are and makes the missing ones (flat mode: on its buffer); with
        release, under ``accumulating()``: it steps nothing."""
        reached, weights = self._draw_backward(data)
        with self.ours.accumulating():
            self._backward(self.ours_p, reached, weights)
        self._backward(self.ref_p, reached, weights)

    @rule(data=st.data(), then_step=st.booleans())
    def set_a_grad_to_none_then_accumulate(self, data, then_step):
        """One grad set to None by hand while others are kept, then a backward that reaches it (and a step on what
        it left): that grad starts again from zero while the others add up (flat mode: its part of the buffer still
        holds its old grad, beside grads in use)."""
        n = len(self.ours_p)
        if sum(a.grad is not None for a in self.ours_p) < 2:  # (grads to keep and one to drop: a backward first)
            weights = [self._draw(p.shape) for p in self.ref_p]
            with self.ours.accumulating():
                self._backward(self.ours_p, [True] * n, weights)
            self._backward(self.ref_p, [True] * n, weights)
        held = [i for i, a in enumerate(self.ours_p) if a.grad is not None]
        i = data.draw(st.sampled_from(held), label="grad set to None")
        self.ours_p[i].grad = self.ref_p[i].grad = None
        reached, weights = self._draw_backward(data)
        reached[i] = True
        with self.ours.accumulating():
            self._backward(self.ours_p, reached, weights)
        self._backward(self.ref_p, reached, weights)
        # (not on grads a GradScaler step left scaled, or inf: stepped, they make NaN on both sides)
        finite = all(bool(b.grad.isfinite().all()) for b in self.ref_p if b.grad is not None)
        if then_step and finite and not self.grads_scaled:
            self.stepped_in_backward = False
            self._step(self.ours.step, self.ref.step)

    # (a second stepping backward before step() or zero_grad() is refused: tests/engine/test_release.py)
    @precondition(lambda self: self.release and not self.stepped_in_backward)
    @rule(data=st.data())
    def released_backward(self, data):
        """A backward steps the params it reaches inside it (on the grads they had plus its own) and frees their
        grads. torch's twin: the same backward, then a step of exactly those params (the others' grads hidden
        from it), then their grads set to None."""
        reached, weights = self._draw_backward(data)
        self._backward(self.ref_p, reached, weights)
        hidden = [None if r else b.grad for b, r in zip(self.ref_p, reached)]
        for b, r in zip(self.ref_p, reached):
            if not r:
                b.grad = None
        flushes = self.ours._release.flushes
        self._step(lambda: self._backward(self.ours_p, reached, weights), self.ref.step)
        for b, r, g in zip(self.ref_p, reached, hidden):
            b.grad = None if r else g
        assert all(a.grad is None for a, r in zip(self.ours_p, reached) if r), "a released backward left grads"
        if any(reached):
            assert self.ours._release.flushes > flushes, "no bucket stepped inside backward"
            self.stepped_in_backward = True
            self.freed = True
        for old, then in self.retired:
            assert old._release.flushes == then, "an optimizer a reload replaced stepped its params"

    def _check_stored_at_its_width(self, stepped):
        """The storage is really in use: every state of a param that stepped is kept as its format says."""
        if self.state_bits == 32:
            return
        groups = {id(p): g for g in self.ours.param_groups for p in g["params"]}
        for a, b in zip(self.ours_p, self.ref_p):
            if not any(b is q for q in stepped):
                continue
            for name, value in (self.ours.state.get(a) or {}).items():
                if name == "step" or name in self.spec.cls.rule.host_states:  # (host floats)
                    continue
                fmt = self.ours._stepper.state_format(a, name, groups[id(a)])
                kind = ("QuantizedState" if fmt.quantized else "Tensor", torch.bfloat16 if fmt.bits == 16
                        else None if fmt.quantized else a.dtype)
                assert (type(value).__name__, getattr(value, "dtype", None)) == kind, (name, fmt, value)

    def _fresh_state_stored_alike(self, stepping):
        """A state that fastoptim makes with a nonzero value (Rprop's ``step_size``, the lr) is stored at its
        width before its first use; torch makes it inside its step and uses it at full width. At low widths the
        twin gets such a state made before its step, as torch's step would make it, so ``_as_stored`` rounds it
        as fastoptim's storage holds it."""
        rule = self.spec.cls.rule
        if self.state_bits == 32 or rule.eager_state or rule.host_states or getattr(rule, "stages", None):
            return
        for group in self.ref.param_groups:
            for b in group["params"]:
                if not any(b is q for q in stepping) or self.ref.state.get(b):
                    continue
                values = {name: rule.initial_value(name, group)
                          for name, on in zip(rule.state_names, rule.active(group)) if on}
                if any(v != 0 for v in values.values()):
                    self.ref.state[b] = {"step": torch.tensor(0.0),
                                         **{name: torch.full_like(b, v) for name, v in values.items()}}

    def _as_stored(self, params=None, quantized_only=False):
        """torch's twin, at low state widths: each of its states rounded as fastoptim stores that state
        (bf16, or quantized and back) where fastoptim converts one: before and after each step that runs.
        Quantizing dequantized codes gives the same codes, so the twin then holds exactly the values
        fastoptim's storage holds; a state put in between steps reads as put on both sides, and is converted
        when its param next steps (a quantized one loaded by ``load_state_dict``: as it loads). ``params``: the
        twin's params to round (default: all); ``quantized_only``: only states kept quantized."""
        if self.state_bits == 32:
            return
        groups = {id(p): g for g in self.ours.param_groups for p in g["params"]}
        for a, b in zip(self.ours_p, self.ref_p):
            if params is not None and not any(b is q for q in params):
                continue
            for name, value in (self.ref.state.get(b) or {}).items():
                if name == "step" or name in self.spec.cls.rule.host_states or not isinstance(value, torch.Tensor):
                    continue
                fmt = self.ours._stepper.state_format(a, name, groups[id(a)])
                if not fmt.plain and (fmt.quantized or not quantized_only):
                    value.copy_(storage.torch_value(storage.adopt(value, a, fmt), a))

    # --- what must hold after every action ------------------------------------------------------------

    @invariant()
    def params_and_state_agree(self):
        if self.defer_check:
            self.defer_check = False
            return
        for i, (a, b) in enumerate(zip(self.ours_p, self.ref_p)):
            torch.testing.assert_close(a.detach(), b.detach(), atol=ATOL, rtol=RTOL, msg=lambda m: f"param {i}: {m}")
            assert (a.grad is None) == (b.grad is None), (i, a.grad, b.grad)
            if b.grad is not None and not self.grads_scaled:
                torch.testing.assert_close(a.grad, b.grad, atol=ATOL, rtol=RTOL, msg=lambda m: f"grad {i}: {m}")
            ours, ref = self.ours.state.get(a) or {}, self.ref.state.get(b) or {}
            assert set(ours) == set(ref), (i, sorted(ours), sorted(ref))
            for k, v in ref.items():
                if k == "step" or k in self.spec.cls.rule.host_states:  # host numbers here, 0-d tensors in torch
                    assert float(ours[k]) == float(v), (i, k, ours[k], v)  # right whenever it is read
                else:
                    assert_state_close(storage.torch_value(ours[k], a), v, msg=f"param {i} state {k}",
                                       atol=ATOL, rtol=RTOL)
        ours_sd, ref_sd = self.ours.torch_state_dict(), self.ref.state_dict()
        assert set(ours_sd["state"]) == set(ref_sd["state"])
        for index, ref_entry in ref_sd["state"].items():
            entry = ours_sd["state"][index]
            assert set(entry) == set(ref_entry), (index, sorted(entry), sorted(ref_entry))
            for k, v in ref_entry.items():
                if k == "step" or k in self.spec.cls.rule.host_states:
                    assert isinstance(entry[k], torch.Tensor) and float(entry[k]) == float(v), (index, k)
                else:
                    assert_state_close(entry[k], v, msg=f"state_dict {index} {k}", atol=ATOL, rtol=RTOL)
        for ours_g, ref_g in zip(ours_sd["param_groups"], ref_sd["param_groups"]):
            assert ours_g["params"] == ref_g["params"]
            unsaved = self.spec.cls.rule.unsaved_hypers  # (ADOPT's clip_lambda: a function)
            assert not unsaved & set(ours_g), sorted(unsaved & set(ours_g))
            for k in (set(self.spec.cls.rule.defaults) - unsaved) & set(ref_g):
                assert ours_g[k] == ref_g[k], (k, ours_g[k], ref_g[k])


def _elementwise_only(machine):
    """``machine`` drawing only optimizers whose math is one elementwise ``update``: the Triton kernels under
    test run that (staged rules run their per-tensor stages apart; tests/paths/test_stages.py)."""
    def build(self, name, option, flat, seed):
        UserProgram.build(self, name, option, flat, seed)
    build = initialize(name=st.sampled_from(sorted(ELEMENTWISE)), option=st.integers(0, 3), flat=st.booleans(),
                       seed=st.integers(0, 2 ** 16))(build)
    return type(machine.__name__, (machine,), {"build": build})


def _run(machine, examples):
    run_state_machine_as_test(machine, settings=settings(
        max_examples=examples, stateful_step_count=12, deadline=None, derandomize=True,
        suppress_health_check=list(HealthCheck)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("level", LEVELS)
def test_user_programs_match_torch(level, device):
    machine = type(f"UserProgram_{level}", (UserProgram,), {"level": level, "device": device})
    _run(machine, EXAMPLES)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_user_programs_of_each_optimizer_match_torch(name, device):
    """Every optimizer in the registry, whatever the draws above happen to pick: a few programs each, on the
    fused level (what ``impl="auto"`` runs)."""
    def build(self, name, option, flat, seed):
        UserProgram.build(self, name, option, flat, seed)
    machine = type(f"UserProgram_{name}", (UserProgram,), {"level": "fused", "device": device, "build": initialize(
        name=st.just(name), option=st.integers(0, 3), flat=st.booleans(), seed=st.integers(0, 2 ** 16))(build)})
    _run(machine, 5)


def test_user_programs_match_torch_on_the_triton_kernel(monkeypatch):
    """The fused level's Triton kernel, run by Triton's interpreter on CPU tensors: GradScaler's inf check
    happens inside the kernel here, and the skipped step is taken back afterwards."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    machine = _elementwise_only(type("UserProgram_triton", (UserProgram,), {"level": "fused", "expected_path": "triton"}))
    _run(machine, max(EXAMPLES // 2, 5))


@pytest.mark.sample("level", "bits")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", STORED)
@pytest.mark.parametrize("level", LEVELS)
def test_user_programs_with_low_bit_state_match_torch_stored_alike(level, bits, device):
    machine = type(f"UserProgram_{level}_{bits}bit", (UserProgram,), {"level": level, "state_bits": bits,
                                                                      "device": device})
    _run(machine, max(EXAMPLES // 2, 5))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("level", LEVELS)
def test_user_programs_with_gradient_release_match_torch(level, device):
    """Backwards that step what they reach (per-param buckets or one), accumulating backwards, ``step()`` over
    grads set by hand, and reloads into a new released optimizer, between the usual actions."""
    machine = type(f"UserProgram_{level}_release", (UserProgram,), {"level": level, "device": device,
                                                                    "release": True})
    _run(machine, RELEASE_EXAMPLES)


@pytest.mark.sample("level", "bits")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", STORED)
@pytest.mark.parametrize("level", LEVELS)
def test_user_programs_with_gradient_release_and_low_bit_state_match_torch_stored_alike(level, bits, device):
    machine = type(f"UserProgram_{level}_{bits}bit_release", (UserProgram,), {
        "level": level, "state_bits": bits, "device": device, "release": True})
    _run(machine, max(RELEASE_EXAMPLES // 2, 5))


@pytest.mark.parametrize("bits", STORED)
def test_user_programs_with_low_bit_state_on_the_triton_kernel(monkeypatch, bits):
    """The Triton kernel that loads and stores 16/8/4-bit state in registers (Triton's interpreter on CPU
    tensors), under the same user programs: checkpoints, resets, added groups, GradScaler. Steps where only
    plain-state params have grads take other paths, so the kernel is counted over the whole run."""
    pytest.importorskip("triton")
    from fastoptim.paths.triton import stored as triton_stored

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    launches = []
    real_run = triton_stored.run

    def counted(*args, **kwargs):
        launches.append(1)
        return real_run(*args, **kwargs)

    monkeypatch.setattr(triton_stored, "run", counted)
    machine = type(f"UserProgram_triton_{bits}bit", (UserProgram,), {"level": "fused", "state_bits": bits})
    _run(machine, max(EXAMPLES // 2, 5))
    assert launches, "the stored-state kernel never ran"
