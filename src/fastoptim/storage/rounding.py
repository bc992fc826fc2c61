"""16-bit params without an fp32 master copy (``rounding=``): how a bf16 or fp16 param that steps through fp32
is rounded back. ``"nearest"`` is the level's own arithmetic; ``"kahan"`` keeps what rounding to nearest lost in a
buffer of the param's dtype (``KAHAN``) and adds it back at the next step; ``"stochastic"`` rounds bf16 up with
probability equal to the fraction of the way to the next value, its random bits a counter-based hash of the
param's seed, its draw count and each element's index (``RNG``: [seed, draws]), so every level, every number of
ranks and a resumed run draw the same bits."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .state import is_dtensor


ROUNDINGS = ("nearest", "stochastic", "kahan")
LOW_PRECISION_PARAMS = (torch.bfloat16, torch.float16)
KAHAN = "kahan_comp"        # per-param state (rounding="kahan"): what the param lost to rounding, its dtype
RNG = "rounding_rng"        # per-param state (rounding="stochastic"): int64 [seed, draws so far]
ROUNDING_STATES = (KAHAN, RNG)
_M32 = 0xFFFFFFFF


def check_rounding(value: Any) -> str:
    if value not in ROUNDINGS:
        raise ValueError(f"Invalid rounding: {value!r} (must be one of {', '.join(map(repr, ROUNDINGS))})")
    return value


def check_rounding_state(name: str, value: Any, p: Tensor) -> str | None:
    """What is wrong with a rounding state found for ``p`` (None: nothing): ``RNG`` an int64 [seed, draws];
    ``KAHAN`` a floating tensor of the param's shape on its device."""
    if name == RNG:
        if not isinstance(value, Tensor) or value.dtype != torch.int64 or tuple(value.shape) != (2,):
            got = f"{value.dtype} {tuple(value.shape)}" if isinstance(value, Tensor) else type(value).__name__
            return f"must be an int64 tensor of shape (2,) (seed, draws), got {got}"
    elif name == KAHAN:
        if not isinstance(value, Tensor) or not value.is_floating_point() or value.shape != p.shape \
                or value.device != p.device:
            got = f"{value.dtype} {tuple(value.shape)} on {value.device}" if isinstance(value, Tensor) \
                else type(value).__name__
            return f"must be a floating tensor of the param's shape {tuple(p.shape)} on {p.device}, got {got}"
    return None


def rounds_in_fp32(dtype: torch.dtype, rounding: str) -> bool:
    """Whether params of ``dtype`` step through fp32 temporaries and are rounded back by ``rounding``: bf16/fp16
    params with stochastic or Kahan rounding. ``"nearest"`` leaves them to the level, as torch.optim does."""
    return rounding != "nearest" and dtype in LOW_PRECISION_PARAMS


def _mix32(x):
    """A bijective 32-bit integer hash (lowbias32), on Python ints or int64 tensors holding 32-bit values."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def rounding_seed(index: int) -> int:
    """The random stream's seed of the ``index``-th param of an optimizer: fixed, so runs repeat, and distinct."""
    return _mix32((_mix32(index + 0x9E3779B9) + 0x632BE5AB) & _M32)


def stochastic_round(x: Tensor, key: int, index: Tensor | None = None) -> Tensor:
    """fp32 ``x`` rounded to bf16, up with probability equal to the fraction of the way to the next bf16 value
    (unbiased: the expectation is ``x``). Element ``i`` draws 16 bits from ``mix32(i + key)``, ``i`` its index in
    the whole param (``index``: ``element_index``; row-major over ``x`` by default); a step's ``key`` comes from
    the param's seed and draw count, so every level, every number of ranks and a resumed run draw the same
    bits. NaN and inf round to nearest."""
    x = x.contiguous()
    if index is None:
        index = torch.arange(x.numel(), dtype=torch.int64, device=x.device).view(x.shape)
    noise = _mix32((index + key) & _M32) >> 16
    bits = x.view(torch.int32).to(torch.int64) & _M32
    up = (bits + noise) & 0xFFFF0000  # sign-magnitude: adding to the magnitude rounds away from zero
    rounded = torch.where(up >= 1 << 31, up - (1 << 32), up).to(torch.int32).view(torch.float32)
    return torch.where(torch.isfinite(x), rounded, x).to(torch.bfloat16)


def element_index(param: Tensor) -> Tensor:
    """Each element's row-major index in the whole param, for this rank's part of it (a DTensor's local shard
    sits at its global offset; a plain tensor is all of itself)."""
    if not is_dtensor(param):
        return torch.arange(param.numel(), dtype=torch.int64, device=param.device).view(param.shape)
    local = param.to_local()
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offsets = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    strides = torch.empty(param.shape, device="meta").stride()
    index = torch.zeros(local.shape, dtype=torch.int64, device=local.device)
    for dim, (size, offset, stride) in enumerate(zip(local.shape, offsets, strides)):
        along = (torch.arange(size, dtype=torch.int64, device=local.device) + offset) * stride
        index += along.view([size if d == dim else 1 for d in range(local.dim())])
    return index


def rounding_state(entry: dict | None, index: int | None, param: Tensor, rounding: str) -> Tensor | None:
    """The rounding's own state for ``param`` (Kahan: the compensation, zeros at first, sharded like the param;
    stochastic: [seed, draws], the seed fixed by the param's ``index``), made in ``entry`` on first use. Returns
    what the step works on (this rank's part)."""
    if rounding == "nearest":
        return None
    name = KAHAN if rounding == "kahan" else RNG
    value = entry.get(name)
    if value is None:
        value = torch.zeros_like(param, memory_format=torch.preserve_format) if rounding == "kahan" else \
            torch.tensor([rounding_seed(index), 0], dtype=torch.int64)
        entry[name] = value
    return value.to_local() if is_dtensor(value) else value


def rounding_key(state: Tensor) -> int:
    """This step's key of a stochastic rounding stream [seed, draws]: what ``stochastic_round`` adds to each
    element's index."""
    seed, draws = (int(v) for v in state.tolist())
    return _mix32((seed ^ _mix32(draws & _M32)) & _M32)


def rounding_keys(states: list[Tensor]) -> Tensor:
    """``rounding_key`` of each stream, as one int64 CPU tensor (for a kernel)."""
    if not states:
        return torch.zeros(0, dtype=torch.int64)
    streams = torch.stack([s.to(device="cpu", dtype=torch.int64) for s in states])
    return _mix32((streams[:, 0] ^ _mix32(streams[:, 1] & _M32)) & _M32)


def round_into(p: Tensor, new: Tensor, state: Tensor, rounding: str, param: Tensor) -> None:
    """fp32 ``new`` into the 16-bit ``p`` (``param``, or this rank's part of it): to nearest; Kahan keeps what
    rounding to nearest lost; stochastic draws the step's bits from [seed, draws] and counts one draw."""
    if rounding != "stochastic":
        p.copy_(new)  # to nearest
        if rounding == "kahan":
            state.copy_(new - p.float())
        return
    p.copy_(stochastic_round(new, rounding_key(state), element_index(param)))
    state[1] += 1
