"""FastOptimizer: torch.optim.Optimizer's surface over one rule's math; the engine runs it.

A step validates every group and plans its buckets (``plan``: params of one device, dtype and step count,
with their state tensors) before it touches anything, so bad hyper-parameters, sparse grads or a bad
state tensor leave params and state as they were; then it commits the plan (new states in place) and hands
it to the dispatcher (``engine.dispatch``), which counts the step and runs each bucket on its paths. The plan is
reused while nothing it was built from changes (``plan`` says what that is). ``state_dict()`` writes the
step counters as torch.optim does (0-d float tensors) and ``load_state_dict`` reads both. With ``flat=True`` each
group's params, grads and states live in one buffer per (device, dtype) (``engine.flat.FlatBucket``). GradScaler:
``engine.amp`` says when the step takes ``grad_scale``/``found_inf`` itself and what it does with them.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Iterable

import torch
from torch import Tensor

from . import bulk, clip, storage
from .eager import eager
from .engine import amp, dispatch, plan, release, release_state
from .engine.flat import FlatBucket
from .loading import check_loaded
from .releasing import GradientRelease
from .paths import sharded
from .rules import Rule
from .storage.state import is_dtensor

STEP_NOT_TRACEABLE = ("fastoptim's step and zero_grad run eagerly under torch.compile (a graph break): they call "
                      "their own C++ and Triton kernels and keep Python-side caches, which Dynamo cannot trace; "
                      "impl='fused'/'compiled' compile the step's math themselves. Call opt.step() outside "
                      "fullgraph=True regions")
STORAGE_SETTINGS = ("state_bits", "min_quant_size", "rounding")  # group keys that say how state is kept


class FastOptimizer(GradientRelease, torch.optim.Optimizer):
    rule: Rule

    def __init__(self, params: Iterable, impl: str = "auto", flat: bool = False,
                 max_grad_norm: float | None = None, state_bits: int | None = None,
                 min_quant_size: int = storage.MIN_QUANT_SIZE, rounding: str = "nearest",
                 state_format: str | None = None, gradient_release: bool = False,
                 release_bucket_mb: float | None = None, **hyper: Any):
        self.impl = dispatch.check_impl(impl)
        self.flat = bool(flat)
        self.state_bits = storage.state_bits_of(state_bits, state_format)  # a group may set its own
        self.min_quant_size = storage.check_min_quant_size(min_quant_size)
        self.rounding = storage.check_rounding(rounding)
        if self.flat and self.rounding != "nearest":
            raise ValueError(f"flat=True rounds to nearest; rounding={rounding!r} needs flat=False")
        if max_grad_norm is not None and (isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float))
                                          or not max_grad_norm > 0):
            raise ValueError(f"Invalid max_grad_norm: {max_grad_norm!r} (must be a number > 0, or None)")
        self.max_grad_norm = max_grad_norm
        self.last_grad_norm: Tensor | None = None  # the global grad norm of the last step, with max_grad_norm
        self._flat_buckets: list[list[FlatBucket]] = []  # per param group, in flat mode
        self._pending_skips: list[tuple] = []  # (found_inf flag, event, what a skip takes back)
        self._plans: dict = {}  # per group (and per released bucket): the last step's buckets, reused while nothing changed
        self._release: release.Release | None = None
        bucket_bytes = release.check(self, gradient_release, release_bucket_mb)
        defaults = dict(self.rule.defaults)
        unknown = set(hyper) - set(defaults)
        if unknown:
            raise TypeError(f"{type(self).__name__} got unexpected argument(s) {sorted(unknown)}; "
                            f"valid: {sorted(defaults)}")
        defaults.update(hyper)
        self.rule.validate(defaults)
        self._group_defaults = {k: defaults.pop(k) for k in self.rule.group_only}
        super().__init__(params, defaults)
        if gradient_release:
            params = [p for group in self.param_groups for p in group["params"]]
            release.check(self, True, release_bucket_mb, params)  # (what needs the params: FSDP2 and clipping)
            self._release = release.Release(self, bucket_bytes)
            self._release.hook(params)
        else:  # (params an older optimizer releases are this one's to step now)
            self._claim = release_state.Claim(self, [p for group in self.param_groups for p in group["params"]])

    # --- state: torch's mapping, counting its changes so the step plan never outlives it ---------------

    @property
    def state(self) -> plan.StateMap:
        """Per-param state, as in torch.optim. Under GradScaler on the fused GPU path a step's inf check is
        read one step late; reading ``state`` while one is pending waits for it, so the counts read here
        are always right."""
        if self.__dict__.get("_pending_skips"):
            self._resolve_skips()
        return self._state

    @state.setter
    def state(self, value) -> None:
        """A new mapping (``opt.state = defaultdict(dict)`` resets the optimizer). Its per-param dicts stay
        the objects you hold; only the mapping itself is wrapped."""
        if self.__dict__.get("_pending_skips"):
            self._resolve_skips()
        self._state = plan.as_state_map(value)

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """Whether torch.amp.GradScaler hands ``step`` grad_scale/found_inf instead of unscaling itself (``amp``).
        GradScaler asks it first in its ``step``: with ``gradient_release`` that is where it is refused."""
        if self.__dict__.get("_release") is not None:
            raise RuntimeError(f"{type(self).__name__}: {release.GRADSCALER_REFUSED}")
        return amp.scales_in_kernel(self)

    @property
    def _bucket_caches(self) -> dict[tuple, dict]:
        """The paths' per-bucket caches of the current plans, by (group index, bucket index): for tests."""
        return {(i, b): bucket.cache for i, p in self._plans.items() for b, bucket in enumerate(p.buckets)}

    # --- param groups ---------------------------------------------------------------------------

    def _all_defaults(self) -> dict[str, Any]:
        """What a new group gets: ``defaults`` and the rule's ``group_only`` defaults."""
        return {**self.defaults, **self._group_defaults}

    def add_param_group(self, param_group: dict) -> None:
        candidate = {k: v for k, v in param_group.items() if k != "params"}
        for k, v in self._all_defaults().items():
            candidate.setdefault(k, v)
        self.rule.validate(candidate)
        self._check_storage(candidate)
        rule = self.rule.for_group(candidate)
        params = param_group["params"]
        if not isinstance(params, set):  # (torch refuses a set, with its own message)
            param_group["params"] = params = [params] if isinstance(params, Tensor) else list(params)
        # named params, (name, tensor) pairs, are checked as their tensors
        tensors = [p[1] if isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) else p for p in params]
        for p in tensors:
            why = rule.check_param(p, candidate) if isinstance(p, Tensor) else None
            if why:
                raise ValueError(why)
        if self.__dict__.get("_release") is not None:
            release.check(self, True, None, tensors)
        for p in tensors:  # a per-tensor stage on sharded params gathers each whole param-shaped tensor, only those
            if rule.stages and isinstance(p, Tensor) and is_dtensor(p) and sharded.shard_dim0(p):
                for n in rule.state_names:
                    shape = rule.state_shape(n, p)
                    if shape not in (None, tuple(p.shape)):
                        raise NotImplementedError(
                            f"{type(self).__name__} keeps state {n!r} of shape {shape} for a sharded (DTensor) "
                            f"param of shape {tuple(p.shape)}: its per-tensor step needs whole tensors, and only "
                            f"param-shaped ones are gathered from the shards; step this param unsharded")
        if self.flat and any(rule.state_shape(n, p) not in (None, tuple(p.shape))
                             for n in rule.state_names for p in tensors if isinstance(p, Tensor)):
            raise ValueError(f"flat=True keeps each state as a view of one buffer shaped like the params; "
                             f"{type(self).__name__} keeps factored states of other shapes: use flat=False")
        if self.flat:  # checked before torch adds the group: a refused group leaves no trace
            by_key: dict[tuple, list[Tensor]] = {}
            for p in tensors:
                if isinstance(p, Tensor):  # (torch refuses the others, with its own message)
                    by_key.setdefault((p.device, p.dtype), []).append(p)
            for ps in by_key.values():
                FlatBucket.check(ps)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for k, v in self._group_defaults.items():  # (after torch's checks: a refused group stays as it was)
            group.setdefault(k, v)
        if self.flat:
            bits, min_quant_size, _ = self._storage_settings(group)

            def kept_apart(p):  # a state not kept as one tensor is no view of a flat buffer (``plan._build_flat``)
                fmt = storage.format_for(p, "", bits, min_quant_size, frozenset())
                return storage.codecs.of(fmt).tensor_dtype(p.dtype) is None
            self._flat_buckets.append([FlatBucket(ps, first=kept_apart) for ps in by_key.values()])
        if self.rule.for_group(group).eager_state:
            for p in group["params"]:
                self._init_state(p, group)
        if self.__dict__.get("_release") is not None:
            self._release.hook(group["params"])
        elif "_claim" in self.__dict__:
            self._claim.claim(group["params"])

    def _init_state(self, p: Tensor, group: dict) -> dict:
        state = self._state[p]
        rule = self.rule.for_group(group)
        if not state:
            if rule.exports_step:
                state["step"] = 0
            for name, needed in zip(rule.state_names, rule.active(group)):
                if needed and rule.state_shape(name, p) is not None:
                    state[name] = self._new_state(p, name, group)
        return state

    def _new_state(self, p: Tensor, name: str, group: dict) -> Tensor | storage.QuantizedState:
        return plan.new_state(self.rule.for_group(group), p, name, group, self._state_format(p, name, group))

    def _storage_settings(self, group: dict) -> tuple[int, int, str]:
        """The group's ``state_bits``, ``min_quant_size`` and ``rounding`` (the optimizer's where the group sets
        none)."""
        return (group.get("state_bits", self.state_bits), group.get("min_quant_size", self.min_quant_size),
                group.get("rounding", self.rounding))

    def _check_storage(self, group: dict) -> None:
        """A group's storage settings, as given or as edited by hand, before anything is made with them."""
        bits, min_quant_size, rounding = self._storage_settings(group)
        storage.check_state_bits(bits, "state_bits of a param group")
        storage.check_min_quant_size(min_quant_size)
        storage.check_rounding(rounding)
        if self.flat and rounding != "nearest":
            raise ValueError("flat=True rounds to nearest; a param group's rounding must be 'nearest'")
        if rounding == "stochastic" and any(p.dtype == torch.float16 for p in group.get("params", ())):
            raise ValueError("rounding='stochastic' rounds fp32 to bf16 params; this group has fp16 params: "
                             "use rounding='kahan' for them")
        if rounding != "nearest" and any(p.dtype == torch.complex32 for p in group.get("params", ())):
            raise ValueError(f"rounding={rounding!r} takes real bf16/fp16 params; this group has complex32 params: "
                             "use rounding='nearest' for them")
        why = self.rule.for_group(group).refuses_quantized_state(group) if storage.codecs.for_bits(bits).quantized \
            else None
        if why:
            raise ValueError(f"{type(self).__name__} with state_bits={bits}: {why}")

    def _state_format(self, p: Tensor, name: str, group: dict) -> storage.Format:
        """How a state of ``p`` is kept: the group's ``state_bits`` (the optimizer's by default)."""
        bits, min_quant_size, _ = self._storage_settings(group)
        rule = self.rule.for_group(group)
        if rule.state_shape(name, p) != tuple(p.shape):  # factored states are small: kept plain
            return storage.Format(32)
        return storage.format_for(p, name, bits, min_quant_size, rule.unsigned_states)

    # --- the step -------------------------------------------------------------------------------

    # Dynamo cannot trace the step (C++ extension calls, the native kernels' build, Python-side caches): a
    # compiled function that calls it breaks its graph here and runs the step eagerly (fullgraph=True: an error)
    @eager(reason=STEP_NOT_TRACEABLE)
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._resolve_skips()
        work = [self._collect(index, group) for index, group in enumerate(self.param_groups)]  # validates
        norm = None if self._release is None else self._release.norm
        factor = None if norm is None else norm.factor  # a measured window: what backward left steps by its factor
        self._run(list(enumerate(self.param_groups)), work, grad_mul=factor)
        if self._release is not None:
            self._release.new_window()
        return loss

    def _run(self, groups: list[tuple[int, dict]], work: list, released: bool = False,
             grad_mul: Tensor | None = None) -> None:
        """Plan (validating everything first), then run each group's step; ``grad_mul``: a clip factor measured
        before (else the grads' own, with ``max_grad_norm``)."""
        keys = [index if not released else (index, tuple(map(id, params))) for (index, _), (_, params, _) in
                zip(groups, work)]
        if released and len(self._plans) > self._release.max_plans():  # buckets made up anew: start again
            self._plans = {k: v for k, v in self._plans.items() if isinstance(k, int)}
        plans = [self._plan(index, group, params, key) for key, (index, _), (group, params, _) in
                 zip(keys, groups, work)]
        step_amp = dispatch.begin_step(self.impl, getattr(self, "found_inf", None),
                                       [self.rule.for_group(group) for group, _, _ in work],
                                       lambda: self._grad_mul(work) if grad_mul is None else grad_mul)
        if step_amp is None:
            return  # GradScaler saw inf/NaN grads: this step changes nothing
        for key, step_plan, (group, _, grads) in zip(keys, plans, work):
            if step_plan is not None:
                self._commit(key, step_plan)
                bits, _, rounding = self._storage_settings(group)
                dispatch.run_plan(self.impl, self.rule.for_group(group), step_plan, group, grads, step_amp, bits,
                                  rounding, self._entry_of)
        if step_amp.found_inf is not None:
            self._pending_skips.append(step_amp.pending())

    def _plan(self, index: int, group: dict, params: list[Tensor], key=None) -> plan.Plan | None:
        """Last step's plan when nothing it was built from changed, else a new one (validated, not yet
        committed: nothing has changed if the step stops here). ``key``: where it is kept (default ``index``)."""
        if not params:
            return None
        cached = self._plans.get(index if key is None else key)
        rule = self.rule.for_group(group)
        shape = (rule, rule.active(group), self._storage_settings(group))  # what the plan's buckets follow from
        if cached is not None and cached.fits(params, shape, self._state):
            return cached
        self._check_storage(group)
        if self.flat:
            self._check_flat_group(index, group)
        self._check_rounding_states(params)
        built = plan.build(rule, group, params, self._state, self._state_format, self._param_index,
                           self._flat_buckets[index] if self.flat else None)
        built.active = shape
        return built

    def _check_rounding_states(self, params: list[Tensor]) -> None:
        """The rounding's own state, as a user may have put it in: checked before anything runs."""
        for p in params:
            for name in storage.ROUNDING_STATES:
                value = self._state[p].get(name) if p in self._state else None
                why = None if value is None else storage.check_rounding_state(name, value, p)
                if why:
                    raise ValueError(f"state {name!r} of param {self._param_index(p)} {why}")

    def _commit(self, key, step_plan: plan.Plan) -> None:
        """A new plan's states put in place (its buckets' path caches start empty); kept for the next step."""
        if self._plans.get(key) is not step_plan:
            step_plan.commit()
            if step_plan.reusable:
                self._plans[key] = step_plan
            else:
                self._plans.pop(key, None)
        if self._release is not None:  # released buckets' plans overlap: one that steps a param outdates the others'
            self._release.stepping(key, step_plan.params, self._plans)  # counts (a plan keeps its params' counts)

    def _entry_of(self, p: Tensor) -> tuple[dict, int, Tensor]:
        """The state dict, optimizer index and param of ``p`` (where a rounding keeps its own state)."""
        return self._state[p], self._param_index(p), p

    def _grad_mul(self, work: list) -> Tensor | None:
        """What the update multiplies the grads by: GradScaler's 1/scale (as GradScaler.unscale_ computes it),
        times the clip factor of ``max_grad_norm`` from the global norm of the unscaled grads."""
        grad_scale = getattr(self, "grad_scale", None)
        grad_mul = None if grad_scale is None else grad_scale.double().reciprocal().float()
        if self.max_grad_norm is None:
            return grad_mul
        grads = []
        for index, (_, _, gs) in enumerate(work):  # flat mode with every grad there: the whole grad buffers
            grads += [b.grad_buffer for b in self._flat_buckets[index]] if self.flat and gs is None else gs
        total = clip.grad_norm(grads)
        if is_dtensor(total):  # sharded grads: the norm is a partial sum until reduced across ranks
            total = total.full_tensor()
        if grad_mul is not None:
            total = total * grad_mul.to(total.device)
        self.last_grad_norm = total
        factor = clip.clip_factor(total, self.max_grad_norm)
        return factor if grad_mul is None else factor * grad_mul.to(factor.device)

    def _resolve_skips(self) -> None:
        """Steps the kernels skipped (found_inf) were counted optimistically; take them back now, reading
        the flag a step later, when the kernel that set it has long finished."""
        pending, self._pending_skips = self._pending_skips, []
        dispatch.resolve_skips(pending, self._state)

    def _collect(self, index: int, group: dict, params: list[Tensor] | None = None
                 ) -> tuple[dict, list[Tensor], list[Tensor] | None]:
        """The params that step (those of ``params``, default the group's, whose grad is not None, as in
        torch.optim) and their grads (in the param's dtype). Flat mode puts grads a user replaced back into the
        buffers first; where every param has its grad there, the grads are None: the step reads the buffers."""
        self.rule.validate(group)
        if params is None:
            params = group["params"]
        if self.flat:
            buckets = self._flat_buckets[index] if index < len(self._flat_buckets) else []
            if all([bucket.repair_grads() for bucket in buckets]):  # (a list: every bucket is repaired)
                return group, group["params"], None
        candidates = params
        params, grads, plain = bulk.with_grads(candidates)
        if plain:
            return group, params, grads
        params, grads = [], []
        for p in candidates:
            g = p.grad
            if g is None:
                continue
            if g.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients "
                                   f"(param {self._param_index(p)}, shape {tuple(p.shape)})")
            if g.dtype != p.dtype:  # torch takes such a grad where ``p.grad_dtype`` allows: the math promotes it
                g = g.to(p.dtype)
            g = g.resolve_neg()  # (a lazily negated view: kernels read its memory as it lies; else g itself)
            params.append(p)
            grads.append(g)
        return group, params, grads

    def _check_flat_group(self, index: int, group: dict) -> None:
        """Flat buffers belong to the group they were made for: a group list edited by hand (a group popped
        or its params changed) would step another group's buffers. Checked when a plan is made (a reused
        plan has the very params it was made with)."""
        buckets = self._flat_buckets[index] if index < len(self._flat_buckets) else []
        owned = [p for bucket in buckets for p in bucket.params]
        params = group["params"]
        if len(owned) != len(params) or not {id(p) for p in owned} == {id(p) for p in params}:
            raise ValueError(f"flat=True: param group {index} no longer holds the params its flat buffers were "
                             "made for (param_groups edited by hand); make a new optimizer for the new groups")

    @eager(reason=STEP_NOT_TRACEABLE)  # (as torch.optim's own zero_grad is)
    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch.optim's. In flat mode ``set_to_none=False`` zeroes each bucket's grad buffer with one memset."""
        self._before_zero_grad(set_to_none)  # (release's refusals: nothing changed yet)
        if not self.flat:
            super().zero_grad(set_to_none)
        for buckets in self._flat_buckets:
            for bucket in buckets:
                bucket.zero_grads(set_to_none)
        if self.__dict__.get("_release") is not None:
            self._release.zeroed()

    def _param_index(self, param: Tensor) -> int:
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                if p is param:
                    return index
                index += 1
        return -1

    # --- state_dict in torch.optim's format -----------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        self._resolve_skips()
        sd = super().state_dict()
        scalar_dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        exported = {}
        for index, state in sd["state"].items():
            entry = {}
            for k, v in state.items():
                if k == "step" or k in self.rule.host_states:
                    v = torch.tensor(float(v), dtype=scalar_dtype)
                entry[k] = v
            exported[index] = storage.export_entry(entry)
        sd["state"] = exported
        return sd

    def torch_state_dict(self) -> dict[str, Any]:
        """The state_dict as torch.optim keeps it, for loading into a torch.optim optimizer: 16/8/4-bit states
        as tensors of their param's shape and dtype (quantized ones dequantized)."""
        sd = self.state_dict()
        params = [p for group in self.param_groups for p in group["params"]]
        for index, entry in sd["state"].items():
            p = params[index]
            plain, parts = storage.split_quantized(entry)
            for name, saved in parts.items():
                plain[name] = storage.import_quantized(name, saved, p)
            sd["state"][index] = {k: storage.torch_value(v, p) for k, v in plain.items()
                                  if k not in storage.ROUNDING_STATES}  # (torch.optim has no use for them)
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch.optim's checkpoints and fastoptim's at any ``state_bits``. How state is kept stays this
        optimizer's choice (its groups keep their ``state_bits`` and ``min_quant_size``): a saved state in
        another format is converted at the next step."""
        kept = check_loaded(self, state_dict)
        # cloned so that stepping never writes into the caller's checkpoint dict; stored states (quantized,
        # 16-bit) go past torch's loader, which casts every state to the param's dtype
        kept_names = {(index, name) for index, _, name, _ in kept}
        state_dict = dict(state_dict)
        # a setting the checkpoint lacks (torch.optim.Muon's has no use_muon or ns_dtype) keeps this group's value
        state_dict["param_groups"] = [{**{k: v for k, v in group.items() if k != "params"}, **saved}
                                      for group, saved in zip(self.param_groups, state_dict["param_groups"])]
        state_dict["state"] = {k: {n: v.clone() if isinstance(v, Tensor) else copy.deepcopy(v)
                                   for n, v in storage.split_quantized(s)[0].items() if (k, n) not in kept_names}
                               for k, s in state_dict["state"].items()}
        self._resolve_skips()  # they speak of the state being replaced (the caches restart in __setstate__)
        own = [{k: group[k] for k in STORAGE_SETTINGS if k in group} for group in self.param_groups]
        super().load_state_dict(state_dict)
        for group, settings in zip(self.param_groups, own):  # how state is kept is this optimizer's choice
            for k in STORAGE_SETTINGS:
                group.pop(k, None)
            group.update(settings)
        for _, p, name, value in kept:
            self._state[p][name] = value

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.update(impl=self.impl, flat=self.flat, max_grad_norm=self.max_grad_norm,
                     state_bits=self.state_bits, min_quant_size=self.min_quant_size, rounding=self.rounding,
                     _flat_buckets=self._flat_buckets, _group_defaults=self._group_defaults,
                     gradient_release=self._release is not None,
                     release_bucket_bytes=None if self._release is None else self._release.bucket_bytes)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__["_pending_skips"] = []  # they speak of the state being replaced
        super().__setstate__(state)
        self.defaults.pop("differentiable", None)  # torch's adds it (no rule takes it): groups would get it below
        if "state" in self.__dict__:  # torch writes the loaded state straight into __dict__
            self._state = plan.as_state_map(self.__dict__.pop("state"), adopt=True)
        # unpickled or deep-copied objects come without the step-to-step caches: start them afresh
        self.__dict__.setdefault("impl", "auto")
        self.__dict__.setdefault("flat", False)
        self.__dict__.setdefault("max_grad_norm", None)
        self.__dict__.setdefault("state_bits", 32)
        self.__dict__.setdefault("min_quant_size", storage.MIN_QUANT_SIZE)
        self.__dict__.setdefault("rounding", "nearest")
        self.__dict__.setdefault("_flat_buckets", [])
        self.__dict__.setdefault("last_grad_norm", None)
        if "_group_defaults" not in self.__dict__:  # pickled before group_only: those keys sat in defaults
            self._group_defaults = {k: self.defaults.pop(k, self.rule.defaults[k]) for k in self.rule.group_only}
        self._plans = {}
        if "gradient_release" in self.__dict__:  # unpickled or deep-copied: hooks on its own params
            released = self.__dict__.pop("gradient_release")
            bucket_bytes = self.__dict__.pop("release_bucket_bytes", None)
            self._release = release.Release(self, bucket_bytes) if released else None
            if released:
                self._release.hook([p for group in self.param_groups for p in group["params"]])
        self.__dict__.setdefault("_release", None)  # (load_state_dict comes here too: its hooks stay)
        for buckets in self._flat_buckets:
            for bucket in buckets:
                bucket.rehome()
        for group in self.param_groups:
            for k, v in self._all_defaults().items():
                group.setdefault(k, v)
        for s in self._state.values():  # counters are host ints (torch's checkpoints hold 0-d tensors)
            step = s.get("step")
            if isinstance(step, Tensor):
                plan.quiet_set(s, "step", int(step.item()))
            for name in self.rule.host_states:  # floats, as the step count is
                if isinstance(s.get(name), Tensor) and s[name].numel() == 1:
                    plan.quiet_set(s, name, s[name].item())
