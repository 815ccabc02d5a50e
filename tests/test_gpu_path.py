"""The GPU path, fifth pass (issue 61), under a GPU's rules on this CPU: what a first run on
one node of 8 GPUs (NCCL) would meet at transitions, in compiled and packed text, in the
cache's copies and in the data-parallel all-reduce. docs/gpus.md says what each test stands
for and what only a GPU can show."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import ROOT, tiny_vit

from pipetransformer.config import load_config

pytestmark = pytest.mark.gpu_rules
QUICKSTART = ROOT / "configs" / "quickstart.yaml"


@pytest.fixture
def fake_world():
    """This process as rank 0 of a world of `size` over torch's `fake` process-group backend
    (collectives return at once, without peers): one rank of a larger layout, built as the
    trainer builds it."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")

    def start(size: int) -> None:
        dist.init_process_group("fake", rank=0, world_size=size, store=FakeStore())

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- DDP's hook


@pytest.mark.parametrize("timed", [False, True], ids=["default", "time_communication"])
def test_the_default_step_reduces_in_ddps_own_all_reduce_without_a_python_hook(timed, fake_world):
    """`CommTimer` replaced DDP's C++ all-reduce by a Python hook in every DDP layout (a
    `.then` callback and two CUDA events per bucket per step), also when nobody asked for
    the timing. The runtime the trainer builds for a DDP layout of 2 replicas (rank 0 of a
    fake world): by default DDP has no communication hook (its reducer all-reduces each
    bucket in C++); with logging.time_communication the timing hook is registered."""
    from torch.nn.parallel import DistributedDataParallel

    from pipetransformer.autodp.groups import build_training_groups
    from pipetransformer.autodp.topology import Layout
    from pipetransformer.autopipe.planner import UnitCosts, balance
    from pipetransformer.pipe.timing import IntervalTimer
    from pipetransformer.trainer.distributed import WorldInfo
    from pipetransformer.trainer.runtime import build_runtime
    from pipetransformer.trainer.tasks import ClassificationTask

    fake_world(2)
    overrides = [f"logging.time_communication={str(timed).lower()}"]
    config = load_config(QUICKSTART, overrides)
    model = tiny_vit()
    plan = balance(UnitCosts.from_param_counts(model.spec.unit_param_counts, 1 / 6), 0, 1)
    layout = Layout(plan, 2, 2, 2)
    world = WorldInfo(0, 2, 0, 2, torch.device("cpu"))
    groups = build_training_groups(layout, 0, 60)
    units = dict(enumerate(model.units))
    timer = IntervalTimer(torch.device("cpu"))
    runtime = build_runtime(
        layout, world, config, units, groups, model.spec, ClassificationTask.loss_fn, timer
    )
    assert isinstance(runtime.wrapped, DistributedDataParallel)
    # DDP's C++ reducer all-reduces each bucket itself unless a hook was registered.
    hooks = [hook for hook, _ in runtime.wrapped._comm_hooks]
    assert hooks == ([runtime.comm_timer.hook] if timed else [])
    assert (runtime.comm_timer is not None) == timed
    groups.destroy()


# ----------------------------------------------------------------------------- handoff


def test_a_run_of_transitions_opens_no_nccl_communicator_per_pair_of_ranks(monkeypatch):
    """The unit handoff at a transition sent each unit with a plain `dist.send` / `dist.recv`
    on the default group: ProcessGroupNCCL opens a 2-rank communicator for every new pair of
    ranks that talk that way, one after another inside the transition, each holding NCCL
    buffers on both GPUs for the rest of the run (the memory model counts none of them).
    Eight ranks (threads over tests/fake_nccl.py: real tensors through mailboxes, NCCL's
    rule for which communicator a call runs on) through transitions 8 -> 4 -> 2 -> 1 stages
    of a tiny BERT, AdamW state with every trained unit: every rank ends with exactly the
    units the new layout gives it, bit-exact, and the handoffs of the whole run used the
    default group's own communicator only (batched point-to-point), however many pairs of
    ranks exchanged units."""
    import copy

    from fake_nccl import FakeNccl
    from helpers import tiny_bert

    from pipetransformer.autodp.handoff import execute_transfers, plan_transfers
    from pipetransformer.autodp.topology import Layout
    from pipetransformer.autopipe.planner import UnitCosts, balance
    from pipetransformer.utils.units import param_key

    model = tiny_bert()
    skeletons = dict(enumerate(tiny_bert(device="meta").units))
    costs = UnitCosts.from_param_counts(model.spec.unit_param_counts, 1 / 6)
    layouts = [
        Layout(balance(costs, f, k), 8, 8, 8 // k) for f, k in [(0, 8), (1, 4), (2, 2), (3, 1)]
    ]
    control = object()  # the gloo control group: object lists only
    fake = FakeNccl(8, control)
    fake.install(monkeypatch)

    def states_of(units: dict) -> dict:
        return {
            param_key(u, name): {"step": torch.tensor(3.0), "exp_avg": p.detach() * 2}
            for u, unit in units.items()
            for name, p in unit.named_parameters()
        }

    held = [
        {u: copy.deepcopy(model.units[u]) for u in layouts[0].units_of_rank(r)} for r in range(8)
    ]
    states = [states_of(units) for units in held]
    pairs = set()
    for old, new in zip(layouts, layouts[1:]):
        transfers = plan_transfers(old, new)
        pairs |= {tuple(sorted((t.src, t.dst))) for t in transfers}

        def hand_over(rank, old=old, new=new, transfers=transfers):
            keep = set(new.units_of_rank(rank))
            received, received_states = execute_transfers(
                transfers,
                rank,
                held[rank],
                states[rank],
                skeletons,
                control,
                torch.device("cpu"),
                keep,
            )
            return {**held[rank], **received}, {**states[rank], **received_states}

        for rank, (units, unit_states) in enumerate(fake.run(hand_over)):
            assert sorted(units) == new.units_of_rank(rank), (rank, new.describe())
            for u, unit in units.items():
                for (name, got), want in zip(
                    unit.state_dict().items(), model.units[u].state_dict().values()
                ):
                    assert torch.equal(got, want), (rank, u, name)
            # What hand_over keeps: the state of the units trained from now on.
            trained = {u: model.units[u] for u in units if u >= new.plan.frozen_end}
            expected = states_of(trained)
            unit_states = {k: v for k, v in unit_states.items() if k in expected}
            assert unit_states.keys() == expected.keys()
            for key, state in unit_states.items():
                assert torch.equal(state["exp_avg"], expected[key]["exp_avg"]), key
            held[rank], states[rank] = units, unit_states
    assert len(pairs) > 8  # units crossed between many pairs of ranks
    assert fake.plain_calls == 0
    assert fake.communicators() == {("group", "world")}
