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

    assert not dist.is_initialized(), "a test left a process group initialised"

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
    from pipetransformer.tasks import ClassificationTask
    from pipetransformer.trainer.distributed import WorldInfo
    from pipetransformer.trainer.runtime import build_runtime

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


# ----------------------------------------------------------------------------- zero bubble


def test_zero_bubble_reduces_each_chunk_when_its_weight_gradients_finish_in_place(
    fake_world, monkeypatch
):
    """Zero bubble's data parallelism flattened every trained gradient into a new buffer
    after the whole step, all-reduced it with nothing left to overlap, and copied it back
    (two gradient-sized copies a step, fully exposed). Rank 0 of a fake world of 2 stages x
    2 replicas (2 chunks a rank, 4 micro-batches), torch's own zero-bubble schedule: each
    chunk's all-reduce starts, asynchronously, right after that chunk's last weight gradient
    (chunk 2's while chunk 0 still has weight gradients to run), on the very buffer the
    gradients are views of; nothing is flattened or unflattened; the step waits for both."""
    from helpers import tiny_bert
    from torch.distributed.pipelining import PipelineStage

    from pipetransformer.autodp.groups import build_training_groups
    from pipetransformer.autodp.topology import Layout
    from pipetransformer.autopipe.planner import UnitCosts, balance
    from pipetransformer.pipe import build_stage_runtime
    from pipetransformer.tasks import ClassificationTask

    fake_world(4)
    model = tiny_bert()
    costs = UnitCosts.from_param_counts(model.spec.unit_param_counts, 1 / 6)
    layout = Layout(balance(costs, 0, 2, virtual_stages=2), 4, 4, 2).with_micro_batches(4)
    groups = build_training_groups(layout, 0, 60)
    log = []
    weight = PipelineStage.backward_weight_one_chunk

    def logged_weight(stage, micro_batch, last_backward=False):
        log.append(("W", stage.stage_index))
        return weight(stage, micro_batch, last_backward=last_backward)

    class Work:
        def wait(self):
            log.append("wait")

    def all_reduce(tensor, op=None, group=None, async_op=False):
        log.append(("all_reduce", tensor.untyped_storage().data_ptr(), async_op))
        return Work() if async_op else None

    def refused(*args, **kwargs):
        raise AssertionError("a gradient-sized copy")

    monkeypatch.setattr(PipelineStage, "backward_weight_one_chunk", logged_weight)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(torch._utils, "_flatten_dense_tensors", refused)
    monkeypatch.setattr(torch._utils, "_unflatten_dense_tensors", refused)
    runtime = build_stage_runtime(
        plan=layout.plan,
        stage_index=0,
        replica_batch_size=8,
        units={u: model.units[u] for u in layout.units_of_rank(0)},
        spec=model.spec,
        loss_fn=ClassificationTask.loss_fn,
        schedule_name="zero_bubble",
        pipeline_group=groups.pipeline,
        data_group=groups.data,
        device=torch.device("cpu"),
    )
    ids = torch.randint(1, 50, (8, 16))
    runtime.train_step([ids, torch.zeros_like(ids), torch.ones_like(ids)], None)
    log.append("end")
    buffers = {
        chunk: [b.flat.untyped_storage().data_ptr() for b in bucket_list]
        for chunk, bucket_list in runtime.gradient_sync.buckets.items()
    }
    assert sorted(buffers) == layout.plan.chunks_of_stage(0) == [0, 2]
    last_weight = {c: max(i for i, e in enumerate(log) if e == ("W", c)) for c in buffers}
    for chunk, pointers in buffers.items():
        (launched,) = [i for i, e in enumerate(log) if e[0] == "all_reduce" and e[1] in pointers]
        assert log[launched][2], "asynchronous"
        assert launched == last_weight[chunk] + 1, (chunk, log)
    assert last_weight[2] < last_weight[0]  # chunk 2 reduces while chunk 0 still computes
    assert log[-3:] == ["wait", "wait", "end"]
    for chunk, bucket_list in runtime.gradient_sync.buckets.items():
        for bucket in bucket_list:
            for p in bucket.parameters:
                assert p.grad.untyped_storage().data_ptr() == buffers[chunk][0]
    groups.destroy()


def test_the_memory_model_counts_no_bucket_copy_of_zero_bubbles_gradients():
    """Zero bubble's gradients are views of the buffers it reduces: a stage of 2 replicas
    holds one copy of its trained gradients, where DDP (interleaved 1F1B) holds its
    buckets besides; a one-stage layout runs DDP under either setting."""
    from pipetransformer.autopipe.memory import LayoutShape, MemoryModel
    from pipetransformer.autopipe.planner import UnitCosts, balance

    model = MemoryModel((100,) * 6, (10,) * 6, (4,) * 6, 2, 2.0)
    costs = UnitCosts.from_param_counts([1] * 6, 1 / 6)
    chunked = balance(costs, 0, 2, virtual_stages=2)
    for schedule, buckets in [("zero_bubble", 0.0), ("interleaved_1f1b", 400.0)]:
        shape = LayoutShape(4, 4, 2, schedule)
        memory = model.stage_memory(chunked, 0, shape)
        assert (memory.gradients, memory.ddp_buckets) == (400.0, buckets), schedule
        one_stage = model.stage_memory(balance(costs, 0, 1), 0, shape)
        assert one_stage.ddp_buckets == one_stage.gradients == 600.0


# ----------------------------------------------------------------------------- AutoCache


def test_cached_rows_go_to_the_device_on_a_side_stream_ordered_by_events(monkeypatch):
    """Cached rows were copied to the device on the compute stream, queued behind the
    previous step's kernels and in front of stage 0's compute (about 97 MB a step for
    ViT-B/16 on CIFAR in bfloat16). AutoCache's CUDA path on fake CUDA tensors against a
    real store (the first 6 of 12 samples cached), streams and events faked and logged in
    order (gpu_audit.FakeCudaStreams), three steps: each step's rows are copied on a side
    stream made once, the copy's event recorded there; the compute stream waits for that
    event (the host does not) before it converts a row, and marks every row as used on it
    (the allocator must not reuse a row's memory on the side stream while the compute stream
    may read it); the host waits for a copy's event only before refilling that pinned buffer
    two steps later."""
    from gpu_audit import FakeCudaStreams
    from helpers import tiny_vit
    from torch._subclasses.fake_tensor import FakeTensorMode

    from pipetransformer.autocache import CacheClient, CacheDaemon
    from pipetransformer.pipe.prefix import CachedPrefix

    fake = FakeCudaStreams()
    fake.install(monkeypatch)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)  # no fake kernel
    log = fake.log

    class Logged:
        def __init__(self, client) -> None:
            self.client = client

        def layout(self, split):
            return self.client.layout(split)

        def read(self, split, ids, out=None, as_stored=False, length=None):
            log.append(("read",))
            return self.client.read(split, ids, out=out, as_stored=as_stored, length=length)

        def write(self, split, ids, layer, tensors):
            log.append(("write",))

    cuda = torch.device("cuda", 0)
    model = tiny_vit(device="meta")
    specs = list(model.spec.activation_specs)
    with (
        CacheDaemon.start({"train": (12, specs)}, memory_budget_bytes=1 << 26) as daemon,
        CacheClient.attach(daemon.address) as client,
    ):
        client.write("train", list(range(6)), 1, [spec.example(6, "cpu") for spec in specs])
        with FakeTensorMode(allow_non_fake_inputs=True):
            units = {i: unit.to_empty(device=cuda) for i, unit in enumerate(model.units)}
            prefix = CachedPrefix(units, 1, Logged(client), cuda)
            images = torch.empty(12, 1, 8, 8, device=cuda)
            starts = []
            for _ in range(3):
                starts.append(len(log))
                prefix("train", list(range(12)), (images,))
    assert fake.made["side"] == 1  # one side stream, made once
    for step, start in enumerate(starts):
        end = starts[step + 1] if step + 1 < len(starts) else len(log)
        calls = log[start:end]
        read = calls.index(("read",))
        copies = [i for i, e in enumerate(calls) if e == ("copy", "side1")]
        assert len(copies) == len(specs) and min(copies) > read, calls
        (recorded,) = [e for e in calls if e[0] == "record" and e[2] == "side1"]
        event = recorded[1]
        after = calls.index(recorded)
        assert after > max(copies)
        waited = calls.index(("wait_event", "compute", event))
        assert calls[after + 1 : waited + 1] == [("wait_event", "compute", event)]
        marked = calls[waited + 1 : waited + 1 + len(specs)]
        assert marked == [("record_stream", "compute")] * len(specs)
        first_use = calls.index(("use", "compute"))
        assert first_use > waited and ("use", "side1") not in calls
        assert ("host_wait", event) not in calls  # the host does not wait for it in the step
        if step == 2:  # buffer 1 again: refilled only after step 0's copy is done
            step_zero = [e for e in log[: starts[1]] if e[0] == "record" and e[2] == "side1"]
            assert calls.index(("host_wait", step_zero[0][1])) < read


# ----------------------------------------------------------------------------- compiled text


@pytest.fixture
def dynamo():
    """A clean dynamo and its settings and the graph counts put back afterwards."""
    from pipetransformer.models.compiled import COMPILES

    config = torch._dynamo.config
    saved = (config.recompile_limit, config.fail_on_recompile_limit_hit)
    compiles = dict(COMPILES)
    torch._dynamo.reset()
    yield COMPILES
    torch._dynamo.reset()
    config.recompile_limit, config.fail_on_recompile_limit_hit = saved
    COMPILES.clear()
    COMPILES.update(compiles)


SST2_LOCAL = ROOT / "configs" / "bert_sst2_local.yaml"
# Replica batches of 4 samples (real lengths; max_seq_length 16, multiples of 8): padded to
# 16 tokens and to 8, each packing into fewer rows than samples.
LENGTH_SETS = ([3, 3, 3, 16], [3, 3, 3, 3])


def micro_batches(config, pipe_len: int, num_micro_batches: int, lengths: list[int]):
    """The first micro-batch of the replica batch of samples of `lengths`, as the trainer
    shapes it (trainer/step.py `step_seq_length`: padded, or packed where data.padding says)
    for a layout of `pipe_len` stages and `num_micro_batches` micro-batches: token ids, token
    types, mask (or segment ids and sample starts)."""
    from types import SimpleNamespace

    from pipetransformer.trainer.step import step_seq_length
    from pipetransformer.utils.packing import Packing
    from pipetransformer.utils.padding import PackedShape, padded_length

    data = config.data
    dataset = SimpleNamespace(
        lengths=lengths,
        batch_length=lambda ids: padded_length(
            max(lengths[i] for i in ids), data.pad_to_multiple_of, data.max_seq_length
        ),
    )
    layout = SimpleNamespace(
        pipe_len=pipe_len, plan=SimpleNamespace(num_micro_batches=num_micro_batches)
    )
    shape = step_seq_length(config, layout, dataset, list(range(len(lengths))))
    width = shape.row_length if isinstance(shape, PackedShape) else shape
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    padded = (torch.randint(1, 50, mask.shape) * mask, torch.zeros_like(mask), mask)
    if not isinstance(shape, PackedShape):
        micro = len(lengths) // num_micro_batches
        return tuple(t[:micro] for t in padded)
    ids, types, segments, starts = Packing(lengths, shape).inputs(padded)
    rows, samples = shape.rows, shape.samples
    return ids[:rows], types[:rows], segments[:rows], starts[:samples]


def run_units(units, inputs, num_frozen: int, evaluation: bool) -> None:
    """One micro-batch through every unit as a stage runs them: the first `num_frozen` units
    frozen (eval mode, no autograd), the rest trained, then backward; or an evaluation."""
    for index, unit in enumerate(units):
        trained = index >= num_frozen
        unit.requires_grad_(trained)
        unit.train(trained and not evaluation)
    x = inputs
    for index, unit in enumerate(units):
        with torch.set_grad_enabled(index >= num_frozen and not evaluation):
            x = unit(*x) if isinstance(x, tuple) else unit(x)
    if not evaluation:
        x.float().sum().backward()


@pytest.mark.parametrize("padding", ["auto", pytest.param("packed", marks=pytest.mark.slow)])
def test_compiled_units_stay_under_their_graph_bound_with_packed_and_padded_batches(
    padding, dynamo
):
    """Under data.padding auto (the default) packed batches compile graphs of their own: with
    micro-batches of 4, 2 and 1 samples, padded and packed, BERT's attention unit reached
    exactly the limit of 16, and a packed micro-batch in one row passed it (an error in the
    middle of a step). A tiny BERT compiled (dynamo's graphs, eager backend), the batches
    the trainer makes of two replica batches of 4 samples at 1, 2 and 4 micro-batches in a
    pipeline (bucketed shapes), all units trained and after a transition freezing layer 0,
    each trained and evaluated: the attention unit (the class with the most states) within
    `unit_graph_bound` for the padding, reaching it under auto, a form's worth of graphs
    under the limit. About 6 s (18 s on 2 loaded cores: dynamo's first compile); packed is
    slow (4 s more: auto reaches every form already)."""
    from helpers import tiny_bert

    from pipetransformer.models import compiled
    from pipetransformer.models.compiled import UNIT_STATES, compile_units, unit_graph_bound

    overrides = [
        f"data.padding={padding}",
        "data.max_seq_length=16",
        "data.pad_to_multiple_of=8",
        "trainer.compile=true",
    ]
    config = load_config(SST2_LOCAL, overrides)
    units = list(tiny_bert(seq_len=16).units)
    # The class with the most states and forms (the others' graphs are a subset of its).
    attention = [u for u in units if type(u).__name__ == "BertAttentionUnit"]
    compile_units(attention, "eager", text=True)
    before = dynamo["BertAttentionUnit"]
    packed = 0
    for num_frozen in (0, 3):  # a transition freezes layer 0: its units frozen, 3 first trained
        for num_micro_batches in (1, 2, 4):
            for lengths in LENGTH_SETS:
                batch = micro_batches(config, 2, num_micro_batches, lengths)
                packed += len(batch) == 4
                run_units(units, batch, num_frozen, evaluation=False)
                run_units(units, batch, num_frozen, evaluation=True)
    assert packed > 0  # packed batches were made
    bound = unit_graph_bound(one_sample=True, packed=True)
    graphs = dynamo["BertAttentionUnit"] - before
    assert graphs <= bound
    if padding == "auto":  # every state of every form: padded, of one sample, packed
        assert graphs == bound == 12
    assert compiled.UNIT_RECOMPILE_LIMIT - bound >= UNIT_STATES  # a form's worth of room


# ----------------------------------------------------------------------------- compile warm-up

COMPILED_VIT = {
    "trainer": {
        "epochs": 1,
        "global_batch_size": 16,
        "nproc_per_node": 1,
        "device": "cpu",
        "progress_bar": False,
        "log_interval_steps": 1000,
        "compile": True,
        "compile_backend": "eager",
    },
    "optimizer": {"name": "sgd", "lr": 0.05},
    "model": {
        "name": "vit_tiny_patch16_224",
        "kwargs": {"patch_size": 4, "embed_dim": 32, "depth": 2, "num_heads": 2},
    },
    "data": {"name": "digits", "image_size": 8, "train_subset": 160, "eval_subset": 20},
    "pipeline": {"initial_pipe_len": 1, "balance": "params", "num_micro_batches": 4},
    "freeze": {"strategy": "gradient_norm", "interval_steps": 1000},
    "cache": {"enabled": False},
}


def _new(before: dict, after: dict) -> dict:
    new = {name: count - before.get(name, 0) for name, count in after.items()}
    return {name: count for name, count in new.items() if count}


def _compiled_bert(sst2_root) -> dict:
    """COMPILED_VIT's run with a tiny BERT on SST-2 text, packed, in bf16."""
    import copy

    config = copy.deepcopy(COMPILED_VIT)
    config["trainer"]["precision"] = "bf16"
    config["model"] = {
        "name": "bert",
        "kwargs": {
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "intermediate_size": 64,
        },
    }
    config["data"] = {
        "name": "sst2",
        "root": str(sst2_root),
        "max_seq_length": 32,
        "train_subset": 160,
        "eval_subset": 16,
        "padding": "packed",
    }
    return config


@pytest.mark.parametrize("kind", ["vit", pytest.param("bert-packed", marks=pytest.mark.slow)])
def test_a_compiled_layout_compiles_every_graph_before_its_first_step(kind, tmp_path, sst2_dir):
    """Units compiled at their first forward: on the first step and again after every
    transition, while the ranks downstream sat in posted NCCL receives (a large model or a
    slow host reaches the NCCL timeout). One process, `trainer.compile` (dynamo's graphs,
    eager backend), micro-batches of 4 samples: setup compiles every graph the layout runs
    (each class trained and evaluated), so neither the steps nor an evaluation compile one; the
    transition that freezes layer 0 compiles the frozen and first-trained variants before
    its first step, records the seconds as its `compile_s`, and again nothing compiles in
    the steps and the evaluation after it. The same with a tiny BERT's packed text in bf16
    (slow: 28 s on 2 loaded cores; the ViT run about 8 s, 20 s loaded)."""
    from helpers import run_workers
    from workers import warmed_run

    config = COMPILED_VIT if kind == "vit" else _compiled_bert(sst2_dir)
    (result,) = run_workers(warmed_run, 1, config, str(tmp_path / "run"), 1, 2)
    setup, first, transition, second = result["compiles"]
    assert _new({}, setup), "setup compiled the layout's graphs"
    assert _new(setup, first) == {}, "the first steps and evaluation compiled nothing"
    assert _new(first, transition), "the transition compiled its new variants"
    assert _new(transition, second) == {}, "nothing compiled after the transition either"
    record = result["transition"]
    assert 0 < record["compile_s"] <= record["total_s"]
    assert all(loss is not None for loss in result["losses"])


def test_a_unit_past_its_graph_limit_fails_every_rank_before_a_step():
    """A unit class past its graph limit raised on the one rank that compiled it, in the
    middle of a step, leaving its peers blocked in NCCL until the watchdog. Two gloo ranks
    warm a DDP layout's compiled units (pipe/warmup.py) as the trainer does before a first
    step, rank 1 with a limit of one graph a class: both ranks raise, after waiting for each
    other, naming rank 1 and the key."""
    from helpers import run_workers
    from workers import warm_up_with_a_limit

    messages = run_workers(warm_up_with_a_limit, 2)
    assert messages[0] == messages[1]
    assert messages[0].startswith("trainer.compile: rank 1 could not compile its units")
    assert "needed more than 1 compiled graphs" in messages[0]


# ----------------------------------------------------------------------------- varlen attention


def _packed_micro_batch(lengths: list[int], rows: int, width: int = 16):
    """A micro-batch of samples of `lengths` packed in `rows` rows of `width` tokens (more
    rows than it needs: the last ones empty), as the trainer makes it."""
    from pipetransformer.utils.packing import Packing
    from pipetransformer.utils.padding import PackedShape

    shape = PackedShape(rows, width, len(lengths))
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    padded = (torch.randint(1, 50, mask.shape) * mask, torch.zeros_like(mask), mask)
    return Packing(lengths, shape), Packing(lengths, shape).inputs(padded)


def test_varlen_offsets_cut_a_packed_batch_at_its_samples_and_row_ends():
    """Every sample a piece, the padding at each row's end a piece (empty where the row is
    full), an empty row a piece, computed on the device without a host read, as many as
    samples + rows + 1 whatever the values (a shape the pipeline and compiled graphs can
    declare)."""
    from gpu_audit import HostReads

    from pipetransformer.models.packed import varlen_offsets

    # Rows of 16 (longest first): [12, 3] and 1 of padding, [9, 7] full, [5] and 11 of
    # padding, an empty row.
    _, (_, _, segments, starts) = _packed_micro_batch([9, 12, 7, 5, 3], rows=4)
    with HostReads() as audit:
        offsets = varlen_offsets(segments, starts)
    assert audit.reads == []
    assert offsets.tolist() == [0, 12, 15, 16, 25, 32, 32, 37, 48, 64]
    flat = segments.reshape(-1)
    for begin, end in zip(offsets.tolist(), offsets.tolist()[1:]):  # one sample, or padding
        assert len(set(flat[begin:end].tolist())) <= 1, (begin, end)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
def test_bert_attention_on_a_packed_batch_by_varlen_equals_the_dense_mask():
    """Packed rows ran block-diagonal masked SDPA, whose cost grows with the square of a
    row's length, where GPUs run padding-free batches through variable-length attention. A
    tiny BERT's attention unit on a packed micro-batch (a full row, a row with padding, an
    empty row), variable-length (SDPA over nested jagged tensors, as it runs on CUDA without
    flash-attention; forced here on the CPU) against the dense mask: the same outputs, every
    token's, and the same gradients."""
    from helpers import tiny_bert

    from pipetransformer.models import packed as packing

    unit = tiny_bert(seq_len=16).units[1].train()  # dropout 0 in the tiny model
    _, (_, _, segments, starts) = _packed_micro_batch([9, 12, 7, 5, 3], rows=4)
    hidden = torch.randn(4, 16, 32)
    results = []
    for varlen in (False, True):
        packing_use = packing.use_varlen
        packing.use_varlen = lambda h, varlen=varlen: varlen
        try:
            x = hidden.clone().requires_grad_(True)
            out = unit(x, segments, starts)[0]
            out.square().sum().backward()
        finally:
            packing.use_varlen = packing_use
        results.append((out.detach(), x.grad, [p.grad.clone() for p in unit.parameters()]))
        unit.zero_grad(set_to_none=True)
    (dense, dense_input, dense_params), (varlen, varlen_input, varlen_params) = results
    torch.testing.assert_close(varlen, dense, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(varlen_input, dense_input, rtol=1e-4, atol=1e-5)
    for got, want in zip(varlen_params, dense_params):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_bert_attention_on_a_gpu_with_flash_attention_calls_its_varlen_kernel(monkeypatch):
    """On CUDA in bfloat16 where the `flash_attn` package is installed, a packed batch goes to
    `flash_attn_varlen_func` (a stand-in recording its arguments; fake CUDA tensors): flat
    (tokens, heads, head_dim) queries, keys and values, int32 cumulative lengths of samples
    + rows + 1 pieces, the row's length as the longest, BERT's scale and its dropout in
    training; no mask is built, and nothing is copied between host and device."""
    import sys
    import types

    from gpu_audit import DeviceCopies
    from helpers import tiny_bert
    from torch._subclasses.fake_tensor import FakeTensorMode

    from pipetransformer.models import packed as packing

    calls = []

    def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, **kwargs):
        calls.append((q.shape, q.dtype, cu_q.dtype, cu_q.shape, max_q, dropout_p, kwargs))
        return torch.empty_like(q)

    flash = types.ModuleType("flash_attn")
    flash.flash_attn_varlen_func = flash_attn_varlen_func
    monkeypatch.setitem(sys.modules, "flash_attn", flash)
    monkeypatch.setattr(packing, "FLASH_ATTN_INSTALLED", True)
    monkeypatch.setattr(packing, "same_sample", lambda *a, **k: pytest.fail("a dense mask"))
    cuda = torch.device("cuda", 0)
    unit = tiny_bert(seq_len=16, device="meta").units[1].to(torch.bfloat16)
    unit.attention.self.dropout.p = 0.1
    _, (_, _, segments, starts) = _packed_micro_batch([9, 12, 7, 5, 3], rows=4)
    with FakeTensorMode(allow_non_fake_inputs=True):
        # bfloat16 weights (CUDA's autocast is off without a GPU, even for fake tensors)
        unit = unit.to_empty(device=cuda).train()
        hidden = torch.empty(4, 16, 32, device=cuda, dtype=torch.bfloat16)
        segments, starts = segments.to(cuda), starts.to(cuda)
        with DeviceCopies() as copies:
            out = unit(hidden, segments, starts)[0]
    assert copies.found == []  # nothing between host and device on the way
    assert out.shape == (4, 16, 32) and out.device.type == "cuda"
    ((shape, dtype, cu_dtype, cu_shape, longest, dropout, kwargs),) = calls
    assert (tuple(shape), dtype) == ((64, 2, 16), torch.bfloat16)
    assert (cu_dtype, tuple(cu_shape), longest, dropout) == (torch.int32, (10,), 16, 0.1)
    assert kwargs["softmax_scale"] == pytest.approx(16**-0.5)


@pytest.mark.parametrize("family, refused", [("deberta-v2", True), ("bert", False)])
def test_padding_auto_pads_per_batch_where_the_attention_takes_no_packed_batch(family, refused):
    """data.padding auto with an attention implementation that takes no mask
    (`flash_attention_2`) raised at the first packed forward, naming a `packed` setting the
    user never set. Resolved at config time now: for a family without a variable-length
    path, auto becomes per-batch padding with a note for the start line, and packed is one
    line naming data.padding; BERT's units run packed batches under it (varlen)."""
    from pipetransformer.config import ConfigError, resolve_padding
    from pipetransformer.models.packed import refusal_for

    config = load_config(SST2_LOCAL, [])
    assert config.data.padding == "auto"
    reason = refusal_for(family, "flash_attention_2")
    assert (reason is not None) == refused
    assert refusal_for(family, "sdpa") is None and refusal_for(family, "eager") is None
    resolved, note = resolve_padding(config, reason)
    if not refused:
        assert resolved is config and note is None
        return
    assert resolved.data.padding == "batch"
    assert note.startswith("data.padding auto: per-batch padding (attention 'flash_attention_2'")
    with pytest.raises(ConfigError, match="^data.padding: 'packed' needs attention confined"):
        resolve_padding(load_config(SST2_LOCAL, ["data.padding=packed"]), reason)
    assert resolve_padding(load_config(SST2_LOCAL, ["data.padding=batch"]), reason)[1] is None


def test_the_trainer_resolves_padding_before_planning_and_says_so_at_the_start(
    monkeypatch, sst2_dir, caplog
):
    """The trainer's own set-up (`_build_model`, before the plan and the resolved config are
    written), for a model whose units refuse packed batches (the refusal stubbed: a flash
    attention model needs a GPU): data.padding auto becomes batch and the data line at the
    start says why."""
    import logging

    from pipetransformer.config import config_from_dict
    from pipetransformer.trainer import trainer as trainer_module
    from pipetransformer.trainer.distributed import WorldInfo

    monkeypatch.setattr(trainer_module, "packed_refusal", lambda model: "no packed path")
    config = config_from_dict(
        {
            "model": {
                "name": "bert",
                "kwargs": {
                    "hidden_size": 32,
                    "num_hidden_layers": 1,
                    "num_attention_heads": 2,
                    "intermediate_size": 64,
                },
            },
            "data": {
                "name": "sst2",
                "root": str(sst2_dir),
                "max_seq_length": 16,
                "train_subset": 32,
                "eval_subset": 8,
            },
        }
    )
    trainer = trainer_module.Trainer.__new__(trainer_module.Trainer)
    trainer.config, trainer.world = config, WorldInfo(0, 1, 0, 1, torch.device("cpu"))
    with caplog.at_level(logging.INFO, logger=trainer_module.__name__):
        trainer._build_model(None)
    assert trainer.config.data.padding == "batch"
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("data: ")]
    assert line.endswith("; data.padding auto: per-batch padding (no packed path)")


# ----------------------------------------------------------------------------- small pieces


@pytest.mark.parametrize("compiled", [False, True])
def test_packed_shapes_are_one_form_of_input_for_compiled_units(compiled):
    """A micro-batch of one sample is never packed (one row: the padded batch itself, and a
    graph of its own for compiled units); compiled, a packed micro-batch takes at least two
    rows, so no packed dimension has size 1 (models/compiled.py `unit_graph_bound`)."""
    from pipetransformer.trainer.step import batch_shape
    from pipetransformer.utils.padding import PackedShape

    overrides = ["data.padding=packed", f"trainer.compile={str(compiled).lower()}"]
    config = load_config(SST2_LOCAL, overrides)
    lengths = [3, 3, 3, 3]
    assert batch_shape(config, lengths, 1, 8, bucketed=True) == 8  # one sample: padded
    shape = batch_shape(config, lengths, 4, 16, bucketed=False)  # all four fit one row
    assert shape == PackedShape(2 if compiled else 1, 16, 4)


def test_zero_bubbles_buffer_counts_a_missing_or_replaced_gradient(fake_world):
    """After `prepare` every trained gradient is a view of its chunk's buffer; one that a
    step set to None counts as zero and one that something replaced is copied in, so every
    replica reduces the same bytes and every parameter leaves with a view of the average."""
    from pipetransformer.pipe.gradient_sync import GradientAllReduce

    fake_world(2)  # the fake all-reduce leaves the values: the average is half of them
    first, second = torch.nn.Linear(3, 2), torch.nn.Linear(2, 1)
    chunks = {0: list(first.parameters()), 1: list(second.parameters())}
    sync = GradientAllReduce(chunks, dist.group.WORLD)
    sync.prepare()
    (bucket,) = sync.buckets[0]
    assert all(p.grad.data_ptr() >= bucket.flat.data_ptr() for p in first.parameters())
    first(torch.ones(4, 3)).sum().backward()
    made = first.weight.grad.clone()
    first.bias.grad = None  # a step left it without a gradient
    second.weight.grad = torch.full_like(second.weight, 4.0)  # replaced, not accumulated
    sync()
    torch.testing.assert_close(first.weight.grad, made / 2)
    assert torch.equal(first.bias.grad, torch.zeros(2))
    assert torch.equal(second.weight.grad, torch.full_like(second.weight, 2.0))
    for p in [*first.parameters(), *second.parameters()]:
        assert p.grad._base is not None  # a view of its chunk's buffer
    # A gradient that holds something before a step (not zeroed since) keeps it: the step
    # adds to it, as a backward does; gradients set to None start from zero.
    second.zero_grad(set_to_none=True)
    held = first.weight.grad.clone()
    sync.prepare()
    torch.testing.assert_close(first.weight.grad, held)
    assert torch.equal(second.weight.grad, torch.zeros_like(second.weight))
    first(torch.ones(4, 3)).sum().backward()
    sync()
    torch.testing.assert_close(first.weight.grad, (held + made) / 2)


def test_the_compare_report_says_when_a_run_did_not_time_its_all_reduce(tmp_path):
    """A run without logging.time_communication records no DDP time: its report cell says
    so rather than 0.0%; a run from before the key timed it (its share is shown)."""
    from pipetransformer.compare.report import _comm_share, _timed_communication

    assert _timed_communication(tmp_path)  # no config.yaml: an old run
    (tmp_path / "config.yaml").write_text("logging:\n  time_communication: false\n")
    assert not _timed_communication(tmp_path)
    assert _comm_share({"ddp_comm_share": 0.0, "ddp_comm_timed": False}) == "not timed"
    assert _comm_share({"ddp_comm_share": 0.125}) == "12.5%"


def test_the_warm_up_runs_every_familys_units_and_leaves_no_trace():
    """What the warm-up runs before a compiled layout's first step (pipe/warmup.py), eagerly
    here: every family's units (tests/families.py) in every state, padded, of one sample and
    packed (text), under bf16 autocast, the first 3 frozen: nothing fails on its inputs of
    zeros, and the weights, gradients, modes and random stream are as they were (a compiled
    run trains what an eager one does)."""
    from families import FAMILIES

    from pipetransformer.pipe.warmup import warm_up_forms, warm_up_units

    for name, family in FAMILIES.items():
        model = family.build(dropout=True)
        units = dict(enumerate(model.units))
        for index, unit in units.items():
            unit.requires_grad_(index >= 3)
            unit.train(index % 2 == 0)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        forms = warm_up_forms(model.spec, [4], packs=True, one_sample=True)
        assert len(forms) == (3 if model.spec.text else 2), name
        rng = torch.get_rng_state()
        warm_up_units(units, 3, model.spec, forms, torch.device("cpu"), torch.bfloat16)
        assert torch.equal(torch.get_rng_state(), rng), name
        for key, value in model.state_dict().items():
            assert torch.equal(value, before[key]), (name, key)
        for index, unit in units.items():
            assert unit.training == (index % 2 == 0), (name, index)
            assert all(p.grad is None for p in unit.parameters()), (name, index)
