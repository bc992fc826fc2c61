"""The Triton paths (CUDA, and CPU tensors under ``TRITON_INTERPRET=1``): the generated multi-tensor kernel
(``kernels``), one launch per bucket, for fp32, bf16 and fp16 (complex64 through its real view); and its
twin for 16/8/4-bit state (``stored``), which loads and stores each state in registers, one launch per
bucket and state formats, and also rounds bf16 params stochastically or with Kahan's compensation. Both read
GradScaler's found_inf inside the kernel (no host sync)."""

from __future__ import annotations

import torch

from ...native import bulk
from ..base import Bucket, Path, StepContext, is_dtensor, subset


class Triton(Path):
    """Takes buckets of a dtype the kernel takes (fp64 and complex128 go elsewhere); leaves the tensors it cannot
    take (misaligned, non-contiguous)."""
    name = "triton"
    records = False  # reported per launch (a bucket with nothing left to launch reports nothing)
    takes_grad_mul = True
    counted = False  # written through their addresses

    def skips_in_kernel(self, ctx: StepContext) -> bool:
        return True

    def takes(self, bucket: Bucket, ctx: StepContext) -> list[int] | None:
        from . import kernels as triton_kernels

        return None if triton_kernels.takes(bucket.params[0].dtype) else []

    def run(self, part: Bucket, ctx: StepContext) -> list[int] | None:
        from . import kernels as triton_kernels

        table = part.cache.get("triton_table")
        if table is None:
            table = part.cache["triton_table"] = triton_kernels.TensorTable()
        rule = ctx.rule
        # (a step the kernel skips for found_inf is counted as a write too: the flag is on the device, and a count
        # too many only refuses a backward)
        return triton_kernels.run(rule.update, rule.state_names, part.params, part.grads, part.states, ctx.scalars,
                                  ctx.flags, table, grad_mul=ctx.grad_mul, found_inf=ctx.found_inf) or None


def _seen(bucket: Bucket, by_formats: dict[tuple, list[int]]) -> tuple:
    """What the state tensors of the params the kernel takes are now (kinds and addresses): the split holds while
    they stay so."""
    from ...storage import codecs

    states = [t for formats, indices in by_formats.items() for k, fmt in enumerate(formats) if fmt is not None
              for i in indices for t in codecs.of(fmt).tensors(bucket.states[k][i])]
    return bulk.kinds(states), bulk.layouts(states, shapes=False)


class TritonStored(Path):
    """Takes the params whose 16/8/4-bit state the kernel loads and stores in registers (``signature``). With
    ``ctx.rounding`` "stochastic" or "kahan" the bucket's bf16 params are rounded as ``storage.rounding.round_into``
    rounds them, with their rounding state from ``ctx.entries(i)``: the kernel then takes the whole bucket or
    none of it (the staged path finds each param's rounding state by its index in the bucket). A stochastic
    step reads found_inf on the host: a skipped step must not count a draw."""
    name = "triton_stored"
    records = False  # reported per launch
    takes_grad_mul = True
    counted = False
    stable_split = True  # its tables live in the part's cache

    def skips_in_kernel(self, ctx: StepContext) -> bool:
        return ctx.rounding != "stochastic"

    @staticmethod
    def _by_formats(bucket: Bucket, rounding: str) -> tuple[dict[tuple, list[int]], list[int]]:
        """The params the kernel takes, by their state formats, and the rest: worked out once per bucket and
        again when a grad's dtype, contiguity or shape changes, or a taken param's state tensors were re-laid,
        re-typed or moved in place (``takes`` and ``run`` both ask, each step)."""
        from . import stored as triton_stored

        grads = bulk.kinds(bucket.grads)
        cached = bucket.cache.get(("triton_stored_split", rounding))
        if cached is not None and cached[0] == grads and cached[1] == _seen(bucket, cached[2][0]):
            return cached[2]
        by_formats: dict[tuple, list[int]] = {}
        rest = []
        for i in range(len(bucket.params)):
            formats = triton_stored.signature(bucket.params, bucket.grads, bucket.states, i, rounding)
            (rest if formats is None else by_formats.setdefault(formats, [])).append(i)
        bucket.cache[("triton_stored_split", rounding)] = (grads, _seen(bucket, by_formats), (by_formats, rest))
        return by_formats, rest

    @staticmethod
    def _rounding_states(bucket: Bucket, ctx: StepContext) -> list:
        from ... import storage

        return [storage.rounding.rounding_state(*ctx.entries(i), ctx.rounding) for i in range(len(bucket.params))]

    def takes(self, bucket: Bucket, ctx: StepContext) -> list[int] | None:
        by_formats, rest = self._by_formats(bucket, ctx.rounding)
        if ctx.rounding == "nearest":
            return None if not rest else sorted(i for indices in by_formats.values() for i in indices)
        if rest:
            return []
        if ctx.rounding == "stochastic" and any(is_dtensor(ctx.entries(i)[2]) for i in range(len(bucket.params))):
            return []  # a shard draws by each element's index in the whole param: the staged path knows it
        own = self._rounding_states(bucket, ctx)
        if ctx.rounding == "kahan" and not all(c.dtype == torch.bfloat16 and c.is_contiguous() and c.shape == p.shape
                                               for c, p in zip(own, bucket.params)):
            return []
        return None

    def run(self, part: Bucket, ctx: StepContext) -> None:
        from . import stored as triton_stored
        from ... import storage

        rounding = ctx.rounding
        by_formats, _ = self._by_formats(part, rounding)
        own = None if rounding == "nearest" else self._rounding_states(part, ctx)
        found_inf = ctx.found_inf if self.skips_in_kernel(ctx) else None
        tables = part.cache.setdefault("triton_stored_tables", {})
        for formats, indices in by_formats.items():
            one = part if len(indices) == len(part.params) else subset(part, indices)
            table = tables.get((formats, rounding))
            if table is None:
                table = tables[formats, rounding] = triton_stored.StoredTable()
            keys = storage.rounding.rounding_keys([own[i] for i in indices]) if rounding == "stochastic" else None
            comps = [own[i] for i in indices] if rounding == "kahan" else None
            triton_stored.run(ctx.rule.update, one.params, one.grads, one.states, formats, ctx.scalars, ctx.flags,
                              table, grad_mul=ctx.grad_mul, found_inf=found_inf, rounding_keys=keys, comps=comps)
        if rounding == "stochastic":
            for stream in own:
                stream[1] += 1  # one draw per step, as ``storage.rounding.round_into`` counts


TRITON = Triton()
TRITON_STORED = TritonStored()
