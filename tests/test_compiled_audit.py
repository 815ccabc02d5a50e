"""`trainer.compile` under a GPU's rules: what the eager audits cannot see (a dispatch mode
makes dynamo run the units eagerly), read from the graphs inductor lowers
(tests/compiled_audit.py); how many graphs a unit class needs, and that needing more is an
error; and why a split-backward schedule refuses compiled units."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from compiled_audit import GraphAudit, forward_graphs_on
from gpu_audit import HostReads
from helpers import ROOT, run_cli, tiny_bert
from torch._dynamo.utils import counters

from pipetransformer.models import compiled
from pipetransformer.models.compiled import COMPILES, compile_unit, compile_units

pytestmark = pytest.mark.gpu_rules
QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")

_names = itertools.count()


@pytest.fixture
def dynamo():
    """A clean dynamo (no graphs of other tests' backends on the units' code) and its
    settings put back afterwards; yields a function registering a backend under a new name."""
    config = torch._dynamo.config
    saved = (config.recompile_limit, config.fail_on_recompile_limit_hit)
    compiles = dict(COMPILES)  # other tests count the classes they compile
    torch._dynamo.reset()

    def register(backend) -> str:
        if isinstance(backend, str):  # one of torch's
            return backend
        name = f"test_backend_{next(_names)}"
        torch._dynamo.register_backend(backend, name=name)
        return name

    yield register
    torch._dynamo.reset()
    config.recompile_limit, config.fail_on_recompile_limit_hit = saved
    COMPILES.clear()
    COMPILES.update(compiles)


def _batch(batch_size: int, length: int) -> tuple[torch.Tensor, ...]:
    """Token ids, types and mask of a batch padded to `length` (the first sample half padding)."""
    ids = torch.randint(1, 50, (batch_size, length))
    mask = torch.ones_like(ids)
    mask[0, length // 2 :] = 0
    return ids * mask, torch.zeros_like(ids), mask


def _run(units, num_frozen: int, batch_size: int, length: int, evaluation: bool) -> None:
    """One micro-batch through every unit under bf16 autocast, as a stage runs them: the
    first `num_frozen` units frozen (eval mode, no autograd, no gradient to keep), the rest
    trained, then backward; or an evaluation (every unit in eval mode without autograd)."""
    x = _batch(batch_size, length)
    for index, unit in enumerate(units):
        trained = index >= num_frozen
        unit.requires_grad_(trained)
        unit.train(trained and not evaluation)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for index, unit in enumerate(units):
            with torch.set_grad_enabled(index >= num_frozen and not evaluation):
                x = unit(*x) if isinstance(x, tuple) else unit(x)
    if not evaluation:
        x.float().sum().backward()


# ----------------------------------------------------------------------------- item: the audit


def test_under_a_dispatch_mode_dynamo_runs_a_compiled_unit_eagerly(dynamo):
    """Why the compiled units need an audit of their own: while gpu_audit.HostReads (a
    TorchDispatchMode) is active, dynamo skips the compiled graph and runs the unit's Python
    eagerly, so the mode sees eager code, not what a compiled step runs."""
    runs = []

    def counting(graph_module, example_inputs):
        def run(*args):
            runs.append(1)
            return graph_module(*args)

        return run

    unit = torch.nn.Linear(8, 8)
    compile_unit(unit, dynamo(counting))
    for _ in range(3):
        unit(torch.randn(4, 8))
    assert len(runs) == 3
    with HostReads():
        for _ in range(3):
            unit(torch.randn(4, 8))
    assert len(runs) < 6, "dynamo ran the compiled graph under a dispatch mode: audit it so"


def test_the_graph_audit_finds_a_host_read_compiled_into_a_graph(dynamo):
    """The audit's own check: `nonzero` captured into a graph (dynamo's
    capture_dynamic_output_shape_ops; its output's size is a value the host must read) is
    reported. (A `.item()` scaling a tensor is no such case: inductor's joint-graph passes
    keep the value on the device.)"""
    audit = GraphAudit()
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        positions = torch.compile(lambda x: x.nonzero() * 2, backend=dynamo(audit))
        positions(torch.randn(4))
    assert [g.host_reads() for g in audit.graphs] == [["aten.nonzero.default"]]


def test_compiled_units_in_every_state_read_nothing_on_the_host_and_recast_per_micro_batch(
    dynamo,
):
    """BERT's attention units (the class with the most states) compiled for inductor (its
    graphs recorded before code generation), under bf16 autocast, at two length buckets and
    two micro-batch sizes, in the four states a unit runs in: frozen, first trained (its
    input carries no gradient), trained, evaluation. One graph per state (4: lengths and
    micro-batch sizes are dynamic), no graph break (nothing runs eagerly between graphs), no
    host read or copy between devices in any graph. Autocast's cast of each weight is in
    the forward graph, so a step of M micro-batches casts each weight M times (eagerly:
    once a step, test_gpu_rules.py), and the backward graph takes the low-precision weights
    the forward cast instead of casting again: each micro-batch in flight holds its own
    bfloat16 copy of the unit's matrices until its backward. About 10 s on 2 cores."""
    audit = GraphAudit()
    units = list(tiny_bert(seq_len=16).units)
    attention = [u for u in units if type(u).__name__ == "BertAttentionUnit"]
    before, breaks = COMPILES["BertAttentionUnit"], sum(counters["graph_break"].values())
    compile_units(attention, dynamo(audit), text=True)
    for batch_size, length in itertools.product((4, 2), (16, 8)):
        # units 0-2 (embedding, layer 0) frozen: layer 1's attention is the first trained
        _run(units, 3, batch_size, length, evaluation=False)
        _run(units, 3, batch_size, length, evaluation=True)
    assert COMPILES["BertAttentionUnit"] - before == 4
    assert sum(counters["graph_break"].values()) == breaks
    graphs = audit.graphs
    assert sorted(audit.kinds().items()) == [("backward", 2), ("forward", 2), ("inference", 2)]
    for graph in graphs:
        assert graph.host_reads() == [], (graph.kind, graph.host_reads())
        assert graph.device_moves(torch.device("cpu")) == [], graph.device_moves("cpu")
    matrices = [
        tuple(m.weight.shape) for m in attention[0].modules() if isinstance(m, torch.nn.Linear)
    ]
    low_precision = 2 * len(matrices)  # autocast casts each linear layer's weight and bias
    transposed = {(cols, rows) for rows, cols in matrices}  # as the backward's matmuls take them
    held = []
    for graph in graphs:
        if graph.kind == "backward":
            assert graph.weight_casts() == 0
            shapes = [s for s in graph.saved_low_precision() if all(isinstance(d, int) for d in s)]
            held.append(sum(shape in transposed for shape in shapes))
        else:
            assert graph.weight_casts() == low_precision, graph.kind
    # The first trained unit needs no input gradient through query, key and value: it holds
    # the output projection's copy only; a trained unit holds all four.
    assert sorted(held) == [1, len(matrices)]


@pytest.mark.parametrize("family_name", ["bert", pytest.param("all", marks=pytest.mark.slow)])
def test_compiled_forwards_copy_nothing_between_host_and_device(family_name, dynamo):
    """Every unit compiled and run on fake CUDA tensors (the devices a GPU run has; the
    graphs for inference, the backward cannot be traced without a GPU): no copy between host
    and device and no tensor made on the host inside any graph, library code included (the
    code dynamo traces can differ from the eager code the eager audit saw:
    transformers branches on `is_tracing`). DeBERTa's attention scale is a 0-dim host tensor
    a kernel reads as a scalar, not a copy. Slow for all families: about 60 s."""
    from families import FAMILIES, batch
    from torch._subclasses.fake_tensor import FakeTensorMode

    cuda = torch.device("cuda", 0)
    names = list(FAMILIES) if family_name == "all" else [family_name]
    for name in names:
        torch._dynamo.reset()
        family = FAMILIES[name]
        model = family.build(dropout=True).train()
        inputs = batch(family)

        def compile_and_run(backend, model=model, inputs=inputs, family=family):
            compile_units(model.units, dynamo(backend), text=family.text)
            with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
                model.to(cuda)
                model(*[t.to(cuda) for t in inputs])

        graphs = forward_graphs_on(cuda, compile_and_run)
        assert len(graphs) >= len({type(u) for u in model.units}), name
        for graph in graphs:
            assert graph.device_moves(cuda) == [], (name, graph.device_moves(cuda))


# ----------------------------------------------------------------------------- recompiles


def test_a_unit_class_past_its_graph_limit_is_an_error_naming_trainer_compile(dynamo, monkeypatch):
    """Dynamo runs a code object eagerly, silently, once it has compiled `recompile_limit`
    graphs for it; compiled units make that an error naming the key. With a limit of 1, a
    unit's second state (evaluation after training) raises."""
    monkeypatch.setattr(compiled, "UNIT_RECOMPILE_LIMIT", 1)
    torch._dynamo.config.recompile_limit = 1
    unit = tiny_bert().units[2]
    compile_unit(unit, dynamo("eager"), (0, 1))
    assert torch._dynamo.config.fail_on_recompile_limit_hit
    hidden, mask = torch.randn(4, 16, 32), torch.ones(4, 16, dtype=torch.long)
    unit(hidden, mask)[0].sum().backward()
    unit.eval()
    with pytest.raises(RuntimeError, match=r"^trainer.compile: BertMlpUnit needed more than 1"):
        with torch.no_grad():
            unit(hidden, mask)


@pytest.mark.slow
def test_bert_compiled_with_inductor_across_buckets_micro_batches_and_states(dynamo):
    """The whole tiny BERT compiled with inductor (C++ kernels generated), under bf16
    autocast, at two length buckets and micro-batches of 4, 2 and 1, in every state its units
    run in: all trained (the embedding first), 3 units frozen (layer 1's attention first
    trained), evaluation; dynamo's own limit of 8 graphs a class, past which the compiled
    units raise. Graphs per class: the attention unit 8 (four states, each again for a
    micro-batch of one sample, whose size dynamo specialises), the MLP and the embedding 6
    (trained, frozen, evaluation: the first trained unit is an attention unit, the embedding
    or the head), the head 4 here (trained, evaluation; first trained only when every layer
    is frozen): within dynamo's default and half `UNIT_RECOMPILE_LIMIT`. No graph break, no
    host read, no copy between devices. Cost: about 3 minutes on 2 shared cores (24 graphs
    and their backward, each generated and built with gcc; the audit turns inductor's
    on-disk caches off, so every run pays it)."""
    audit = GraphAudit(codegen=True)
    units = list(tiny_bert(seq_len=16).units)
    before, breaks = dict(COMPILES), sum(counters["graph_break"].values())
    compile_units(units, dynamo(audit), text=True)
    torch._dynamo.config.recompile_limit = 8  # dynamo's default, not the units' headroom
    for num_frozen, batch_size, length in itertools.product((0, 3), (4, 2, 1), (16, 8)):
        _run(units, num_frozen, batch_size, length, evaluation=False)
        _run(units, num_frozen, batch_size, length, evaluation=True)
    new = {name: COMPILES[name] - before.get(name, 0) for name in COMPILES}
    assert {k: v for k, v in new.items() if v} == {
        "BertEmbeddingUnit": 6,
        "BertAttentionUnit": 8,
        "BertMlpUnit": 6,
        "BertClassificationHead": 4,
    }
    assert sum(counters["graph_break"].values()) == breaks
    for graph in audit.graphs:
        assert graph.host_reads() == [] and graph.device_moves(torch.device("cpu")) == []


# ----------------------------------------------------------------------------- split backward


def _split_backward_matmuls(compile_backend: str | None) -> tuple[int, int, int]:
    """Matmuls of torch's zero-bubble backward over a BERT MLP unit (a chunk of one unit)
    at one micro-batch: (input step, weight step, whole backward), the unit compiled with
    `compile_backend` (None: eager)."""
    from torch.distributed.pipelining._backward import (
        stage_backward,
        stage_backward_input,
        stage_backward_weight,
    )
    from torch.utils._python_dispatch import TorchDispatchMode

    from pipetransformer.models.layered import UnitSequence

    class Matmuls(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
                self.count += 1
            return func(*args, **(kwargs or {}))

    unit = tiny_bert().units[2]
    chunk = UnitSequence([unit], [False])
    if compile_backend is not None:
        compile_units([unit], compile_backend, text=True)
    hidden = torch.randn(4, 16, 32, requires_grad=True)
    mask = torch.ones(4, 16, dtype=torch.long)
    grad = torch.randn(4, 16, 32)
    counts = []
    # The dispatch mode is entered for the backward only: the forward ran compiled.
    output = chunk(hidden, mask)[0]
    with Matmuls() as seen:
        _, weights = stage_backward_input([output], [grad], [hidden], chunk.parameters())
    counts.append(seen.count)
    with Matmuls() as seen:
        stage_backward_weight(chunk.parameters(), weights)
    counts.append(seen.count)
    output = chunk(hidden, mask)[0]
    with Matmuls() as seen:
        stage_backward([output], [grad], [hidden])
    counts.append(seen.count)
    return tuple(counts)


def test_a_compiled_unit_under_torchs_split_backward_runs_its_whole_backward_twice(dynamo):
    """Zero bubble's backward is torch's `stage_backward_input` (I) then
    `stage_backward_weight` (W), each through the autograd graph. Eagerly they split one
    backward's matmuls between them (2 + 2 = 4 for an MLP unit's two linear layers); a
    compiled unit is one autograd node, so I runs its whole compiled backward, dropping the
    weight gradients, and W runs it again: 4 + 4. With AOTAutograd's donated buffers (its
    default) the second run fails outright. So config/checks.py refuses trainer.compile with
    a split-backward schedule, and pipe/runtime.py refuses compiled units under one."""
    assert _split_backward_matmuls(None) == (2, 2, 4)
    with torch._functorch.config.patch(donated_buffer=False):
        assert _split_backward_matmuls(dynamo("aot_eager")) == (4, 4, 4)
    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match="stage backward input"):
        _split_backward_matmuls(dynamo("aot_eager"))


@pytest.mark.parametrize("command", ["train", "plan"])
def test_trainer_compile_under_zero_bubble_is_refused_before_any_process(command):
    """`train` and `plan --predict` (which would price the combination as if it ran): one
    line naming trainer.compile and pipeline.schedule, before a worker starts."""
    extra = ["--predict", "--device", "h100-sxm"] if command == "plan" else []
    result = run_cli(
        command, QUICKSTART, *extra, "trainer.compile=true", "pipeline.schedule=zero_bubble"
    )
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert (
        len(lines) == 1
        and "config error: trainer.compile: pipeline.schedule zero_bubble" in (lines[0])
    ), lines
    assert "twice the matmuls" in lines[0] and "process(es)" not in result.stderr
    assert run_cli("plan", QUICKSTART, "trainer.compile=true").returncode == 0


def test_a_stage_of_compiled_units_under_zero_bubble_is_refused(dynamo):
    """A caller that compiled its units itself: the runtime refuses them before building
    any stage, naming the key."""
    from pipetransformer.autopipe.planner import UnitCosts, balance
    from pipetransformer.pipe import build_stage_runtime
    from pipetransformer.tasks import ClassificationTask

    model = tiny_bert()
    compile_units(model.units, dynamo("eager"), text=True)
    costs = UnitCosts.from_param_counts(model.spec.unit_param_counts, 1 / 6)
    plan = dataclasses.replace(balance(costs, 0, 2, virtual_stages=2), num_micro_batches=2)
    with pytest.raises(ValueError, match="^trainer.compile: pipeline.schedule zero_bubble"):
        build_stage_runtime(
            plan=plan,
            stage_index=0,
            replica_batch_size=4,
            units=dict(enumerate(model.units)),
            spec=model.spec,
            loss_fn=ClassificationTask.loss_fn,
            schedule_name="zero_bubble",
            pipeline_group=None,
            data_group=None,
            device=torch.device("cpu"),
        )
