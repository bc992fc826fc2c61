"""FastOptimizer: torch.optim.Optimizer's face over one rule's math.

The class holds what torch.optim's users touch: the constructor, param groups, ``state``, ``zero_grad``, the
state_dict and pickling, and release's own methods. Every step goes down into its stepper
(``engine.stepper``), which also holds the settings, the plans and flat mode's buffers; with
``gradient_release`` a driver (``engine.release``) calls the same stepper from backward's hooks.
``state_dict()`` writes the step counters as torch.optim does (0-d float tensors) and ``load_state_dict``
reads both (``checkpoints``).
"""

from __future__ import annotations

import copy
from contextlib import nullcontext
from typing import Any, Callable, Iterable

import torch
from torch import Tensor

from . import checkpoints, storage
from .eager import eager
from .engine import dispatch, release, release_ddp, release_state
from .engine.state_map import StateMap, as_state_map, quiet_set
from .engine.stepper import Settings, Stepper
from .rules import Rule

STEP_NOT_TRACEABLE = ("fastoptim's step and zero_grad run eagerly under torch.compile (a graph break): they call "
                      "their own C++ and Triton kernels and keep Python-side caches, which Dynamo cannot trace; "
                      "impl='fused'/'compiled' compile the step's math themselves. Call opt.step() outside "
                      "fullgraph=True regions")
STORAGE_SETTINGS = ("state_bits", "min_quant_size", "rounding")  # group keys that say how state is kept


class _Setting:
    """An optimizer attribute that is one of its stepper's ``Settings`` (read and written there)."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, opt, cls=None):
        return self if opt is None else getattr(opt._stepper.settings, self.name)

    def __set__(self, opt, value) -> None:
        setattr(opt._stepper.settings, self.name, value)


class FastOptimizer(torch.optim.Optimizer):
    rule: Rule
    impl = _Setting()
    flat = _Setting()
    max_grad_norm = _Setting()
    state_bits = _Setting()
    min_quant_size = _Setting()
    rounding = _Setting()

    def __init__(self, params: Iterable, impl: str = "auto", flat: bool = False,
                 max_grad_norm: float | None = None, state_bits: int | None = None,
                 min_quant_size: int = storage.MIN_QUANT_SIZE, rounding: str = "nearest",
                 state_format: str | None = None, gradient_release: bool = False,
                 release_bucket_mb: float | None = None, **hyper: Any):
        settings = Settings(impl=dispatch.check_impl(impl), flat=bool(flat),
                            state_bits=storage.state_bits_of(state_bits, state_format),  # a group may set its own
                            min_quant_size=storage.check_min_quant_size(min_quant_size),
                            rounding=storage.rounding.check_rounding(rounding))
        if settings.flat and settings.rounding != "nearest":
            raise ValueError(f"flat=True rounds to nearest; rounding={rounding!r} needs flat=False")
        if max_grad_norm is not None and (isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float))
                                          or not max_grad_norm > 0):
            raise ValueError(f"Invalid max_grad_norm: {max_grad_norm!r} (must be a number > 0, or None)")
        settings.max_grad_norm = max_grad_norm
        self._stepper = Stepper(self, rule=self.rule, settings=settings, state=as_state_map({}))
        self._release: release.Release | None = None
        name = type(self).__name__
        bucket_bytes = release.check(name=name, settings=settings, gradient_release=gradient_release,
                                     release_bucket_mb=release_bucket_mb)
        defaults = dict(self.rule.defaults)
        unknown = set(hyper) - set(defaults)
        if unknown:
            raise TypeError(f"{name} got unexpected argument(s) {sorted(unknown)}; valid: {sorted(defaults)}")
        defaults.update(hyper)
        self.rule.validate(defaults)
        self._group_defaults = {k: defaults.pop(k) for k in self.rule.group_only}
        super().__init__(params, defaults)
        params = [p for group in self.param_groups for p in group["params"]]
        if gradient_release:  # (what needs the params: FSDP2 and clipping)
            release.check(name=name, settings=settings, gradient_release=True, release_bucket_mb=release_bucket_mb,
                          params=params)
            self._release = release.Release(self._stepper, bucket_bytes)
            self._release.hook(params)
        else:  # (params an older optimizer releases are this one's to step now)
            self._claim = release_state.Claim(self._stepper, params)

    # --- state: torch's mapping, counting its changes so the step plan never outlives it ---------------

    @property
    def state(self) -> StateMap:
        """Per-param state, as in torch.optim. Under GradScaler on the fused GPU path a step's inf check is
        read one step late; reading ``state`` while one is pending waits for it, so the counts read here
        are always right."""
        self._stepper.resolve_skips()
        return self._stepper.state

    @state.setter
    def state(self, value) -> None:
        """A new mapping (``opt.state = defaultdict(dict)`` resets the optimizer). Its per-param dicts stay
        the objects you hold; only the mapping itself is wrapped."""
        self._stepper.resolve_skips()
        self._stepper.state = as_state_map(value)

    @property
    def last_grad_norm(self) -> Tensor | None:
        """With ``max_grad_norm``: the global grad norm of the last step (or of the measured window)."""
        return self._stepper.last_grad_norm

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """Whether torch.amp.GradScaler hands ``step`` grad_scale/found_inf instead of unscaling itself (``amp``).
        GradScaler asks it first in its ``step``: with ``gradient_release`` that is where it is refused."""
        if self._release is not None:
            raise RuntimeError(f"{type(self).__name__}: {release.GRADSCALER_REFUSED}")
        return self._stepper.scales_in_kernel()

    # --- param groups ---------------------------------------------------------------------------

    def add_param_group(self, param_group: dict) -> None:
        candidate = {k: v for k, v in param_group.items() if k != "params"}
        for k, v in {**self.defaults, **self._group_defaults}.items():
            candidate.setdefault(k, v)
        self.rule.validate(candidate)
        params = param_group["params"]
        if not isinstance(params, set):  # (torch refuses a set, with its own message)
            param_group["params"] = params = [params] if isinstance(params, Tensor) else list(params)
        # named params, (name, tensor) pairs, are checked as their tensors
        tensors = [p[1] if isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) else p for p in params]
        flat = self._stepper.admit(candidate, tensors)
        if self._release is not None:
            release.check(name=type(self).__name__, settings=self._stepper.settings, gradient_release=True,
                          release_bucket_mb=None, params=tensors)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for k, v in self._group_defaults.items():  # (after torch's checks: a refused group stays as it was)
            group.setdefault(k, v)
        self._stepper.added(group, flat)
        if self._release is not None:
            self._release.hook(group["params"])
        elif "_claim" in self.__dict__:
            self._claim.claim(group["params"])

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
        rel = self._release  # a measured window: what backward left steps by its factor
        self._stepper.step(found_inf=getattr(self, "found_inf", None), grad_scale=getattr(self, "grad_scale", None),
                           grad_mul=None if rel is None else rel.window_factor())
        if rel is not None:
            rel.new_window()
        return loss

    @eager(reason=STEP_NOT_TRACEABLE)  # (as torch.optim's own zero_grad is)
    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch.optim's. In flat mode ``set_to_none=False`` zeroes each bucket's grad buffer with one memset."""
        release.before_zero_grad(self._release, name=type(self).__name__, groups=self.param_groups,
                                 set_to_none=set_to_none)  # (release's refusals: nothing changed yet)
        if not self.flat:
            super().zero_grad(set_to_none)
        self._stepper.zero_grads(set_to_none)
        if self._release is not None:
            self._release.zeroed()

    # --- gradient release (``engine.release``) ------------------------------------------------------

    @property
    def gradient_release(self) -> bool:
        """Whether the step runs inside backward."""
        return self._release is not None

    def accumulating(self):
        """``with opt.accumulating(): loss.backward()``: with ``gradient_release`` this backward steps nothing (its
        grads add up; the next backward steps on the sum). Without it, a no-op."""
        return self._release.accumulating() if self._release is not None else nullcontext()

    def release_with(self, ddp_model) -> None:
        """``opt.release_with(DistributedDataParallel(model))``: with ``gradient_release``, each DDP bucket steps
        inside backward once its all-reduce is done, on the reduced grads (``engine.release_ddp``)."""
        release_ddp.tie(self._release, ddp_model, name=type(self).__name__, settings=self._stepper.settings)

    def measure_grad_norm(self):
        """``with opt.measure_grad_norm(): loss.backward(retain_graph=True)``, then ``loss.backward()``: the norm that
        ``gradient_release`` clips by with ``max_grad_norm``, measured exactly (``engine.release_norm``)."""
        if self._release is None or self.max_grad_norm is None:
            raise RuntimeError(f"{type(self).__name__}.measure_grad_norm() measures the norm that "
                               f"gradient_release=True clips by; this optimizer has gradient_release="
                               f"{self._release is not None}, max_grad_norm={self.max_grad_norm}: clip in opt.step()")
        self._release.rehook()  # (hooks for params unfrozen since; the window's norms start anew)
        return self._release.measuring().measure()

    # --- state_dict in torch.optim's format -----------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        self._stepper.resolve_skips()
        return checkpoints.export(super().state_dict(), rule=self.rule)

    def torch_state_dict(self) -> dict[str, Any]:
        """The state_dict as torch.optim keeps it, for loading into a torch.optim optimizer: 16/8/4-bit states
        as tensors of their param's shape and dtype (quantized ones dequantized)."""
        params = [p for group in self.param_groups for p in group["params"]]
        sd = self.state_dict()
        sd["param_groups"] = [self.rule.for_group(group).torch_group(group) for group in sd["param_groups"]]
        return checkpoints.to_torch(sd, params=params)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch.optim's checkpoints and fastoptim's at any ``state_bits``. How state is kept stays this
        optimizer's choice (its groups keep their ``state_bits`` and ``min_quant_size``): a saved state in
        another format is converted at the next step."""
        kept = checkpoints.check_loaded(state_dict, groups=self.param_groups, optimizer_rule=self.rule,
                                        state_format=self._stepper.state_format)
        # cloned so that stepping never writes into the caller's checkpoint dict; stored states (quantized,
        # 16-bit) go past torch's loader, which casts every state to the param's dtype
        kept_names = {(k.index, k.name) for k in kept}
        state_dict = dict(state_dict)
        # a setting the checkpoint lacks (torch.optim.Muon's has no use_muon or ns_dtype) keeps this group's value
        state_dict["param_groups"] = [{**{k: v for k, v in group.items() if k != "params"}, **saved}
                                      for group, saved in zip(self.param_groups, state_dict["param_groups"])]
        state_dict["state"] = {k: {n: v.clone() if isinstance(v, Tensor) else copy.deepcopy(v)
                                   for n, v in storage.split_quantized(s)[0].items() if (k, n) not in kept_names}
                               for k, s in state_dict["state"].items()}
        self._stepper.resolve_skips()  # they speak of the state being replaced (the caches restart in __setstate__)
        own = [{k: group[k] for k in STORAGE_SETTINGS if k in group} for group in self.param_groups]
        super().load_state_dict(state_dict)
        for group, settings in zip(self.param_groups, own):  # how state is kept is this optimizer's choice
            for k in STORAGE_SETTINGS:
                group.pop(k, None)
            group.update(settings)
        for k in kept:
            self._stepper.state[k.param][k.name] = k.value

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        settings, rel = self._stepper.settings, self._release
        state.update(impl=settings.impl, flat=settings.flat, max_grad_norm=settings.max_grad_norm,
                     state_bits=settings.state_bits, min_quant_size=settings.min_quant_size,
                     rounding=settings.rounding, _flat_buckets=self._stepper.flat_buckets,
                     _group_defaults=self._group_defaults, gradient_release=rel is not None,
                     release_bucket_bytes=None if rel is None else rel.bucket_bytes)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickled or deep-copied (a new stepper: the caches start afresh), or ``load_state_dict``'s new state
        (the stepper stays; its plans start afresh)."""
        stepper = self.__dict__.get("_stepper")
        if stepper is not None:
            stepper.pending_skips = []  # they speak of the state being replaced
        super().__setstate__(state)
        d = self.__dict__
        d["defaults"].pop("differentiable", None)  # torch's adds it (no rule takes it): groups would get it below
        # (torch writes the state straight into __dict__)
        loaded = as_state_map(d.pop("state"), adopt=True) if "state" in d else None
        if stepper is None:
            settings = Settings(**{k: d.pop(k) for k in ("impl", "flat", "max_grad_norm", "state_bits",
                                                          "min_quant_size", "rounding") if k in d})
            self._stepper = stepper = Stepper(self, rule=self.rule, settings=settings, state=loaded,
                                              flat_buckets=d.pop("_flat_buckets", []))
            for buckets in stepper.flat_buckets:
                for bucket in buckets:
                    bucket.rehome()
        elif loaded is not None:
            stepper.state = loaded
        stepper.plans = {}
        if "_group_defaults" not in d:  # pickled before group_only: those keys sat in defaults
            self._group_defaults = {k: self.defaults.pop(k, self.rule.defaults[k]) for k in self.rule.group_only}
        for k, v in self.rule.defaults.items():  # (pickled before the rule had them: Muon's matrices and split)
            if k not in self.rule.group_only:
                self.defaults.setdefault(k, v)
        if "gradient_release" in d:  # unpickled or deep-copied: hooks on its own params
            released = d.pop("gradient_release")
            bucket_bytes = d.pop("release_bucket_bytes", None)
            self._release = release.Release(stepper, bucket_bytes) if released else None
            if released:
                self._release.hook([p for group in self.param_groups for p in group["params"]])
        d.setdefault("_release", None)  # (load_state_dict comes here too: its hooks stay)
        for group in self.param_groups:
            for k, v in {**self.defaults, **self._group_defaults}.items():
                group.setdefault(k, v)
        for s in stepper.state.values():  # counters are host ints (torch's checkpoints hold 0-d tensors)
            step = s.get("step")
            if isinstance(step, Tensor):
                quiet_set(s, "step", int(step.item()))
            for name in self.rule.host_states:  # floats, as the step count is
                if isinstance(s.get(name), Tensor) and s[name].numel() == 1:
                    quiet_set(s, name, s[name].item())
