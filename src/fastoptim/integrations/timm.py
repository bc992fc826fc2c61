"""fastoptim's optimizers in timm's optimizer factory.

``register()`` adds every optimizer of the registry to timm's registry (``timm.optim.OptimInfo``, timm's
optimizer registry since 1.0.12) under ``fastoptim-<name>``; then timm's factory and train script take them
like timm's own, with fastoptim's settings passed through::

    import timm.optim
    import fastoptim.integrations.timm
    fastoptim.integrations.timm.register()
    opt = timm.optim.create_optimizer_v2(model, "fastoptim-adamw", lr=1e-3, weight_decay=0.05, state_bits=8)

Names take a hyphen: timm's factory reads the part after an underscore as a wrapper's argument
(``lookahead_adamw``) and would make ``fastoptim_adamw`` timm's own AdamW. ``lookahead_fastoptim-adamw`` works.

What timm's factory does with them, as with its own: it always passes ``weight_decay`` (0 when it made the
groups itself, each with its own), ``momentum=0.9`` unless given where the optimizer has a momentum (SGD,
RMSprop, Muon), ``eps`` and ``betas`` only where the optimizer takes them (a float eps: not Adafactor's pair).
Two adapters make that work:

* Rprop takes no weight decay: timm's ``weight_decay=0`` (and groups' 0) are dropped, another value refused;
* Muon (and NorMuon) routes params as timm's Muon does: matrices with two dims above 1, and params of 3+ dims
  whose first two dims are above 1 (conv weights; not position tables (1, n, d), layer scales (d, 1, 1) or
  depthwise filters (c, 1, k, k)), to Muon; the others, and groups timm marks ``use_fallback`` (its
  ``fallback_list=``), to AdamW (``use_muon=False``). Params of 3+ dims are flattened to (d0, d1 * ...), as timm's
  Muon flattens them (``matrices="flatten"`` in a group of their own); NorMuon, which steps 2-D matrices only,
  leaves them to AdamW. Nothing else goes to AdamW by name: pass ``fallback_list=["head*"]`` (or the model's head
  names) to keep the output layer on AdamW, as with timm's Muon.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import Tensor

from ..registry import OPTIMIZERS, OptimizerSpec

PREFIX = "fastoptim-"


def timm_name(spec: OptimizerSpec) -> str:
    return PREFIX + spec.name


def optim_info_kwargs(spec: OptimizerSpec) -> dict[str, Any]:
    """The fields of timm's ``OptimInfo`` for one optimizer, read from its rule's defaults."""
    defaults = spec.cls.rule.defaults
    betas = defaults.get("betas")
    counterpart = f"torch.optim.{spec.torch_counterpart}'s math" if spec.torch_counterpart else "no torch.optim class"
    return dict(
        name=timm_name(spec),
        opt_class=timm_class(spec),
        description=f"fastoptim.{spec.cls.__name__} ({counterpart}), with impl=, flat=, state_bits=",
        has_eps=isinstance(defaults.get("eps"), float),  # (Adafactor's eps is a pair: timm's float would not do)
        has_momentum="momentum" in defaults,
        has_betas=betas is not None,
        num_betas=len(betas) if betas is not None else 2,
    )


def timm_class(spec: OptimizerSpec) -> Callable:
    """What timm's factory calls with (params, **kwargs): the class, or an adapter where timm's conventions need
    one (see the module docstring)."""
    if spec.params == "matrices":
        return _routing_like_timm_muon(spec.cls)
    if "weight_decay" not in spec.cls.rule.defaults:
        return _dropping_zero_weight_decay(spec.cls)
    return spec.cls


def register(registry: Any = None, optim_info: type | None = None) -> list[str]:
    """Register every fastoptim optimizer in timm's optimizer registry (``registry``: timm's default one) and
    return their names. ``optim_info``: timm's ``OptimInfo`` (a stand-in for tests)."""
    if registry is None or optim_info is None:
        try:
            from timm.optim import OptimInfo
            from timm.optim._optim_factory import default_registry
        except Exception as e:  # (timm imports torchvision: one that does not load raises more than ImportError)
            raise ImportError("fastoptim.integrations.timm.register() needs timm with its optimizer registry "
                              f"(timm.optim.OptimInfo, timm 1.0.12 or later): {e}") from e
        registry = default_registry if registry is None else registry
        optim_info = OptimInfo if optim_info is None else optim_info
    names = []
    for spec in OPTIMIZERS.values():
        registry.register(optim_info(**optim_info_kwargs(spec)))
        names.append(timm_name(spec))
    return names


# --- adapters ---------------------------------------------------------------------------------------------------

def _named_like(cls: type, make: Callable) -> Callable:
    make.__name__ = make.__qualname__ = cls.__name__
    make.__doc__ = f"fastoptim.{cls.__name__} as timm's factory calls it.\n\n{cls.__doc__ or ''}"
    return make


def _groups(params) -> list[dict]:
    params = list(params)
    return params if params and isinstance(params[0], dict) else [{"params": params}]


def _dropping_zero_weight_decay(cls: type) -> Callable:
    def make(params, weight_decay: float = 0.0, **kwargs):
        groups = _groups(params)
        if weight_decay or any(g.get("weight_decay") for g in groups):
            raise TypeError(f"{cls.__name__} takes no weight_decay (torch.optim.{cls.__name__} has none); timm "
                            "passed a nonzero one: use weight_decay=0")
        return cls([{k: v for k, v in g.items() if k != "weight_decay"} for g in groups], **kwargs)
    return _named_like(cls, make)


def _on_muon(p) -> bool:
    """timm's Muon's shape rule: two dims, both above 1; or 3+ dims, the first two above 1."""
    t = p[1] if isinstance(p, tuple) else p  # (named params)
    return isinstance(t, Tensor) and t.dim() >= 2 and t.shape[0] > 1 and t.shape[1] > 1


def _dims(p) -> int:
    return (p[1] if isinstance(p, tuple) else p).dim()


def _routing_like_timm_muon(cls: type) -> Callable:
    batched = cls.rule.batched_matrices

    def make(params, **kwargs):
        routed = []
        for group in _groups(params):
            members = group["params"]
            members = [members] if isinstance(members, Tensor) else list(members)
            settings = {k: v for k, v in group.items() if k not in ("params", "use_fallback")}
            muon = not group.get("use_fallback", False) and settings.get("use_muon", True)
            matrices = [p for p in members if muon and _on_muon(p) and _dims(p) == 2]
            filters = [p for p in members if batched and muon and _on_muon(p) and _dims(p) > 2]  # (timm flattens)
            rest = [p for p in members if not any(p is q for q in matrices + filters)]
            routed += [{**settings, "params": matrices}] if matrices else []
            routed += [{**settings, "params": filters, "matrices": "flatten"}] if filters else []
            routed += [{**settings, "params": rest, "use_muon": False}] if rest else []
        return cls(routed, **kwargs)
    return _named_like(cls, make)
