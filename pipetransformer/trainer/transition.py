"""A transition's work on this rank between two stages: the old stage released, its units and
optimizer state handed over to the ranks that hold them next, and the transition's record.

The trainer decides when a transition happens and builds the new stage (trainer.py); the
plan of what moves where is pure (autodp/handoff.py `plan_transfers`). This module only
executes that plan for one rank and describes what happened; it must not plan layouts,
build training groups or decide anything.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass

import torch
from torch import nn

from pipetransformer.autodp.control import Control
from pipetransformer.autodp.handoff import Transfer, execute_transfers
from pipetransformer.autodp.topology import Layout
from pipetransformer.fsdp import gather_units
from pipetransformer.runs.records import TransitionEvent
from pipetransformer.trainer import optim
from pipetransformer.trainer.clock import Tick
from pipetransformer.trainer.step import Stage
from pipetransformer.utils.units import parse_param_key


@dataclass
class Handover:
    """What this rank holds for the new layout: its units and their optimizer state by
    parameter name (frozen units' state dropped), and the seconds releasing the old took."""

    units: dict[int, nn.Module]
    states: dict[str, dict]
    release_s: float


def hand_over(
    old: Stage,
    new: Layout,
    transfers: list[Transfer],
    skeletons: dict[int, nn.Module],
    rank: int,
    control: Control,
    device: torch.device,
) -> Handover:
    """Release `old`'s runtime and optimizer, then send and receive the units of
    `transfers` (collective: every rank, same order)."""
    started = time.perf_counter()
    if old.runtime is not None and old.runtime.cached_prefix is not None:
        old.runtime.cached_prefix.flush()  # rows computed at the old boundary
    states = optim.states_by_name(old.optimizer, old.named_params())
    # The old layout's runtime (DDP's buckets, the pipeline's buffers) and optimizer go
    # before any unit moves, and each unit this rank stops holding goes after its last
    # send: at full size each is hundreds of MiB that would otherwise be held twice
    # (MemoryModel.move_bytes budgets what remains). Reference counting frees them: no
    # cycle holds a runtime (tests/test_elastic.py checks with the collector off), and a
    # full collection of a process that has imported torch, timm and transformers costs
    # most of a transition (0.39 of 0.43 s on the quickstart); leaving a sharded layout
    # is the exception below.
    old.runtime = old.optimizer = None
    # Its list of trained parameters and AutoFreeze's sums (an fp32 copy of each) would
    # keep released units on the device while the new layout is built; the decision
    # point has read the sums, and the new stage starts its own.
    old.grad_owners = old.grad_sums = None
    release_s = time.perf_counter() - started
    if old.layout.sharded:  # every unit in full again, as in a one-stage layout, but
        # those that stay trained in a sharded layout: their shards are cut alike there
        keep = set(range(new.plan.frozen_end, len(skeletons))) if new.sharded else set()
        old.units, states = gather_units(old.units, states, skeletons, device, keep)
        # FSDP2's modules, states and parameter groups refer to one another (hooks, the
        # root's shared context): unlike any other layout's, a sharded layout's shards,
        # gradients and buffers on the device are freed by the collector only. One
        # collection for the one kind of transition that needs it (test_gpu_rules.py).
        gc.collect()
    keep = set(new.units_of_rank(rank))
    received, received_states = execute_transfers(
        transfers, rank, old.units, states, skeletons, control.group, device, keep
    )
    units = {**old.units, **received}
    states.update(received_states)
    # Optimizer state of units frozen from now on is dropped before the new stage exists.
    states = {k: v for k, v in states.items() if parse_param_key(k)[0] >= new.plan.frozen_end}
    return Handover(units, states, release_s)


def transition_event(
    old: Layout,
    new: Layout,
    tick: Tick | None,
    global_step: int,
    units_moved: int,
    move_bytes: list[float],
    grad_norms: list[float] | None,
    times: dict[str, float],
    release_s: float,
) -> TransitionEvent:
    """The record of a transition from `old` to `new` after the step of `tick`."""
    return TransitionEvent(
        epoch=tick.epoch if tick else 0,
        step=tick.steps_done_in_epoch if tick else 0,
        global_step=global_step,
        old_num_frozen_layers=old.plan.num_frozen_layers,
        new_num_frozen_layers=new.plan.num_frozen_layers,
        old_pipe_len=old.pipe_len,
        new_pipe_len=new.pipe_len,
        old_dp_degree=old.dp_degree,
        new_dp_degree=new.dp_degree,
        new_stage_ranges=[list(r) for r in new.plan.stage_ranges],
        num_micro_batches=new.plan.num_micro_batches,
        units_moved=units_moved,
        new_virtual_stages=new.plan.virtual_stages,
        predicted_move_bytes=[int(b) for b in move_bytes],
        layer_grad_norms=grad_norms,
        data_groups=[new.data_ranks(s) for s in range(new.pipe_len)] if new.dp_degree > 1 else [],
        **times,
        release_s=release_s,
        total_s=sum(times.values()),
        old_sharded=old.sharded,
        new_sharded=new.sharded,
    )
