"""A test-only rule with one per-tensor stage whose math is per matrix, as Muon's is: momentum, then the step
scaled by each matrix's norm (the last two dims), so a 3-D (E, M, N) param is E matrices stepped each on its own
and the stage declares ``local_rows`` for it. ``whole=True`` takes the norm over the whole tensor instead, which
needs the whole tensor, so the declaration says no (the flags reach ``local_rows``). Not registered: the tests
build its class (``SliceNorm``) without adding it to the package's optimizers."""

from fastoptim.optimizers import public_class
from fastoptim.rules.base import PerTensor, Rule, check_bool, check_declaration, check_nonnegative

# each rank's calls of the stage: the shape of every batch it ran on (the tests read and clear it)
CALLS: list[tuple] = []


def slice_step(p, g, momentum_buffer, lr, momentum, WHOLE):
    CALLS.append(tuple(p.shape))
    momentum_buffer = momentum_buffer * momentum + g
    dims = tuple(range(1, p.dim())) if WHOLE else (-2, -1)  # (dim 0 is the batch)
    p = p - momentum_buffer * lr / momentum_buffer.square().sum(dim=dims, keepdim=True).sqrt().clamp(min=1e-12)
    return p, momentum_buffer


def per_matrix(shape: tuple, flags: tuple) -> bool:
    whole, = flags
    return len(shape) >= 3 and not whole


class SliceNormRule(Rule):
    name = "slicenorm"
    class_name = "SliceNorm"
    takes = "matrices"
    signature = ("lr", "momentum", "whole")
    defaults = dict(lr=1e-2, momentum=0.9, whole=False)
    state_names = ("momentum_buffer",)
    exports_step = False
    stages = (PerTensor(slice_step, ("param", "grad", "momentum_buffer"), ("param", "momentum_buffer"),
                        local_rows=per_matrix),)

    def check_param(self, p, group):
        return None if p.dim() >= 2 else f"SliceNorm steps matrices and stacks of them, not shape {tuple(p.shape)}"

    def validate(self, group):
        check_nonnegative(group, "lr", "momentum")
        check_bool(group, "whole")

    def named_flags(self, group):
        return dict(WHOLE=group["whole"])

    def named_scalars(self, group, step):
        return dict(lr=group["lr"], momentum=group["momentum"])


RULE = SliceNormRule()
check_declaration(RULE)
SliceNorm = public_class(RULE, module=__name__)
