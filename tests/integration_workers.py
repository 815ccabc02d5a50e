"""Worker functions of the integration tests (run by helpers.run_workers in gloo processes):
DDP's reducer rebuilt after a freeze, on a model small enough to check every weight."""

from __future__ import annotations

import copy
import datetime

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from pipetransformer.integrations.ddp import rebuild_reducer

STEPS, FREEZE_AT, BATCH = 5, 2, 8


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


def reducer_rebuild_run(rebuild: bool) -> dict:
    """SGD on 2 ranks under DDP without find_unused_parameters; after FREEZE_AT steps the
    first Linear freezes (requires_grad off, gradient cleared) and, with `rebuild`, the
    reducer is rebuilt. Beside it, each rank trains a copy on the whole global batch alone
    (the single-process reference of the same steps). A python communication hook counts
    the buckets DDP reduces (it must be carried over to the new reducer). What happened."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model()
    reference = copy.deepcopy(model)
    ddp = DistributedDataParallel(model, find_unused_parameters=False)
    reduced = []

    def counting_allreduce(state, bucket):
        reduced.append(len(bucket.parameters()))
        tensor = bucket.buffer().div_(world)
        return dist.all_reduce(tensor, async_op=True).get_future().then(lambda f: f.value()[0])

    ddp.register_comm_hook(None, counting_allreduce)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    frozen_before = None
    try:
        for step in range(STEPS):
            inputs = torch.randn(BATCH * world, 6, generator=generator)
            targets = torch.randint(0, 2, (BATCH * world,), generator=generator)
            if step == FREEZE_AT:
                for layer in (model[0], reference[0]):
                    for p in layer.parameters():
                        p.requires_grad_(False)
                        p.grad = None
                frozen_before = [p.detach().clone() for p in model[0].parameters()]
                if rebuild:
                    rebuild_reducer(ddp)
                reduced.clear()
            mine = slice(rank * BATCH, (rank + 1) * BATCH)
            loss = nn.functional.cross_entropy(ddp(inputs[mine]), targets[mine])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            reference_loss = nn.functional.cross_entropy(reference(inputs), targets)
            reference_loss.backward()
            reference_optimizer.step()
            reference_optimizer.zero_grad(set_to_none=True)
    except RuntimeError as exc:
        return {"error": str(exc).splitlines()[0]}
    finally:
        dist.destroy_process_group()
    return {
        "error": None,
        "frozen_changed": max(
            float((p - q).abs().max()) for p, q in zip(model[0].parameters(), frozen_before)
        ),
        "against_reference": max(
            float((p - q).abs().max()) for p, q in zip(model.parameters(), reference.parameters())
        ),
        "parameters_reduced_after_freeze": sum(reduced),
        "trained_parameters": sum(1 for p in model.parameters() if p.requires_grad),
    }
