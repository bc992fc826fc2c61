"""The staged path: any path over state kept in another format, through temporaries.

Every non-plain state is loaded into a temporary of its param's dtype (``storage.load``), the dispatcher's route
for plain state steps the temporaries (``ctx.run_plain``), and each is stored back (``storage.store``). A step
GradScaler skips never gets here (the dispatcher reads found_inf first): quantizing dequantized values need not
give the same codes back.

With ``storage.rounding.rounds_in_fp32(dtype, ctx.rounding)`` (bf16/fp16 params, stochastic or Kahan rounding), and for
bf16/fp16 params with states kept at another width, the params, grads and every state step as fp32 temporaries
instead: the rule's math in fp32, then each state stored in its format and each param rounded back by
``ctx.rounding``. ``ctx.entries(i)`` gives the state dict of the bucket's ``i``-th param, its index in the
optimizer and the param itself (a DTensor where the bucket holds its local shard): the rounding keeps its own
state there (``storage.rounding.KAHAN``, ``storage.rounding.RNG``), made on first use.
"""

from __future__ import annotations

from .. import storage
from .base import Bucket, Path, StepContext


class Staged(Path):
    name = "staged"
    records = False       # the path that steps the temporaries reports itself
    takes_grad_mul = True  # (handed on with the temporaries)

    def run(self, part: Bucket, ctx: StepContext) -> None:
        rounding = ctx.rounding
        # 16-bit params step in fp32 where they are rounded by other means, or where a state is kept at another
        # width than theirs (its values are not rounded to the param's dtype on the way: one rounding, at the end)
        dtype = part.params[0].dtype
        fp32 = storage.rounding.rounds_in_fp32(dtype, rounding) or (dtype in storage.rounding.LOW_PRECISION_PARAMS
                                                           and storage.needs_staging(part.params, part.states))
        params, grads = part.params, part.grads
        if fp32:
            owners = [ctx.entries(i) if rounding != "nearest" else (None, None, p) for i, p in enumerate(params)]
            own = [storage.rounding.rounding_state(entry, index, owner, rounding) for entry, index, owner in owners]
            params = [p.float() if rounding != "kahan" else p.float() + comp.float() for p, comp in zip(params, own)]
            grads = [g.float() for g in grads]
        staged, states = [], []
        for lst in part.states:
            if lst is None:
                states.append(None)
                continue
            temps = []
            for state, temp_p in zip(lst, params):
                if storage.is_plain(state, temp_p):
                    temps.append(state)
                else:
                    temp = storage.load(state, temp_p)
                    staged.append((state, temp))
                    temps.append(temp)
            states.append(temps)
        # (fp32 temporaries of 16-bit params need no count of their writes, and are not kept for it: rounding
        # them back into the params counts)
        ctx.run_plain(Bucket(params, grads, states, part.cache.setdefault("staged", {}), part.sharded, transient=True),
                      ctx.but(found_inf=None, written=[] if fp32 else ctx.written))
        for state, temp in staged:
            storage.store(state, temp)
        if fp32:
            for p, new, state, (_, _, owner) in zip(part.params, params, own, owners):
                storage.rounding.round_into(p, new, state, rounding, owner)


STAGED = Staged()
