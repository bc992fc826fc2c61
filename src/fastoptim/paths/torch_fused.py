"""torch's own fused kernel (``rule.torch_fused``: Adam, AdamW, SGD, Adagrad), the fused level's path on the CPU."""

from __future__ import annotations

import torch
from torch import Tensor

from .base import Bucket, Path, StepContext

# torch 2.13's fused CPU SGD is wrong for fp16/bf16 (0.26 off its own single-tensor SGD after 3 steps),
# so low-precision buckets take our own paths
TORCH_FUSED_DTYPES = (torch.float32, torch.float64)


class TorchFused(Path):
    """Takes the params whose tensors are contiguous: torch's kernels walk p, g and states as one linear
    layout. They divide by a grad scale (handed the reciprocal of the multiplier) and do not count their
    writes as autograd's in-place writes (the dispatcher does)."""
    name = "torch_fused"
    takes_grad_mul = True
    counted = False

    def takes_grad_mul_of(self, ctx: StepContext) -> bool:
        # its kernels read the scale as fp32: an fp64 bucket's grads are scaled in fp64 first (the reciprocal of an
        # fp64 clip factor rounded to fp32 would move fp64 params off torch.optim's clip-then-step)
        return ctx.grad_mul.dtype == torch.float32

    @staticmethod
    def declared(rule, dtype: torch.dtype) -> bool:
        return rule.torch_fused is not None and dtype in TORCH_FUSED_DTYPES

    def takes(self, bucket: Bucket, ctx: StepContext) -> list[int] | None:
        # params and states keep their layout while the bucket's cache lives: the step plan makes a new bucket
        # when a state tensor is replaced or a param's address, strides or shape change
        fixed = bucket.cache.get("strided_params_or_states")
        if fixed is None:
            fixed = bucket.cache["strided_params_or_states"] = {
                i for i, p in enumerate(bucket.params)
                if not (p.is_contiguous() and all(s is None or s[i].is_contiguous() for s in bucket.states))}
        if not fixed and all(map(Tensor.is_contiguous, bucket.grads)):
            return None
        return [i for i, g in enumerate(bucket.grads) if i not in fixed and g.is_contiguous()]

    def run(self, part: Bucket, ctx: StepContext) -> None:
        grad_mul = ctx.grad_mul
        ctx.rule.torch_fused(part.params, part.grads, part.states, ctx.group, ctx.step,
                             grad_scale=None if grad_mul is None else grad_mul.reciprocal())


TORCH_FUSED = TorchFused()
