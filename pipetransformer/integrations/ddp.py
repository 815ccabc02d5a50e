"""How another trainer's DDP wrapper stops synchronising a frozen prefix, without
`find_unused_parameters`.

DDP decides at construction which parameters it all-reduces: those that require a gradient
then. Its reducer registers a hook on each and, with `find_unused_parameters=False`, waits
for every one of them in every backward; a parameter frozen later (`requires_grad_(False)`)
never fires its hook, so the next step fails ("Expected to have finished reduction in the
prior iteration") or, with the flag on, pays a traversal of the autograd graph every step
to find it. Wrapping the model again would give a new DDP object, but the trainers hold the
old one (transformers' `Trainer` in a local variable of its training loop, accelerate in
`Accelerator._models`, Lightning in `strategy.model`).

So the wrapper stays and its reducer is built again over the parameters that require a
gradient now: what DDP itself does when it is unpickled (`DistributedDataParallel.
__setstate__`: `_build_params_for_reducer`, then `_ddp_init_helper`), with the old reducer's
autograd hooks removed first and the communication hooks registered on the wrapper put back
on the new reducer. Every rank does it at the same point, between two steps (after an
optimizer step, when no reduction is pending); the buckets are rebuilt from the first
backward's order as at the start (a collective all ranks reach together).

Owns: `ddp_of`, `rebuild_reducer`. Must not: decide what freezes, touch the optimizer.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def ddp_of(model: nn.Module | None) -> DistributedDataParallel | None:
    """The DDP wrapper in `model`'s wrappers (torch.compile's `_orig_mod` and other
    `module` attributes followed outward in), or None."""
    for _ in range(8):
        if model is None or isinstance(model, DistributedDataParallel):
            return model
        inner = getattr(model, "_orig_mod", None)
        model = inner if inner is not None else getattr(model, "module", None)
    return None


def _refusal(ddp: DistributedDataParallel) -> str | None:
    if ddp.mixed_precision is not None:
        return "DDP's own mixed_precision (its reducer keeps low-precision copies)"
    if ddp._delay_all_reduce_params:
        return "DDP's delay_all_reduce_named_params"
    if ddp._use_python_reducer:
        return "DDP's python reducer (compiled autograd)"
    return None


def check_rebuildable(ddp: DistributedDataParallel, owner: str) -> None:
    """ValueError in one line where the wrapper's reducer cannot be built again here."""
    reason = _refusal(ddp)
    if reason is not None:
        raise ValueError(f"{owner}: cannot change what DDP synchronises under {reason}")


def rebuild_reducer(ddp: DistributedDataParallel) -> None:
    """Build `ddp`'s reducer again over the parameters that require a gradient now (module
    docstring). Every rank, between steps."""
    check_rebuildable(ddp, "rebuild_reducer")
    ddp.reducer._remove_autograd_hooks()
    parameters, expect_sparse_gradient = ddp._build_params_for_reducer()
    if not parameters:
        raise ValueError("rebuild_reducer: no parameter of the model requires a gradient")
    names = ddp._build_debug_param_to_name_mapping(parameters)
    ddp._ddp_init_helper(parameters, expect_sparse_gradient, names, ddp.static_graph)
    if ddp.static_graph:  # as __setstate__: the new reducer and logger learn it again
        ddp.reducer._set_static_graph()
        ddp.logger._set_static_graph()
    for hook, state in ddp._comm_hooks:
        dist._register_comm_hook(ddp.reducer, state, hook)
    ddp._has_rebuilt_buckets = False
