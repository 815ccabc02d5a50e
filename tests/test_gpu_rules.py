"""A GPU's rules, enforced on this CPU (the `gpu_rules` marker is the contract; docs/gpus.md
says what each test stands for and what only a GPU can show)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from families import FAMILIES, TEXT_FAMILIES, batch, text_batch
from gpu_audit import HostReads
from helpers import ROOT, run_cli, tiny_bert

from pipetransformer.config import load_config

pytestmark = pytest.mark.gpu_rules

CASES = [(name, True) for name in FAMILIES] + [(name, False) for name in TEXT_FAMILIES]


@pytest.mark.parametrize(
    "name, padded", CASES, ids=lambda v: {True: "padded", False: "unpadded"}.get(v, v)
)
def test_a_forward_and_backward_read_nothing_on_the_host(name, padded):
    """Every unit forward and backward, train mode, every family: no value reaches the host.
    transformers' bidirectional masks read `padding_mask.all()` unless told not to (one
    read per attention unit per micro-batch on a GPU)."""
    family = FAMILIES[name]
    model = family.build(dropout=True).train()
    inputs = batch(family) if padded or not family.text else text_batch(padded=False)
    with HostReads() as audit:
        out = model(*inputs)
        out.float().sum().backward()
    assert audit.reads == []


OPTIMIZERS = [
    ("sgd", "auto"),
    ("adam", "foreach"),
    ("adamw", "foreach"),
    ("adam", "fused"),
    ("adamw", "fused"),
]


@pytest.mark.parametrize(("name", "implementation"), OPTIMIZERS, ids=lambda v: str(v))
def test_the_state_handoff_keeps_every_entry_on_the_device_torch_expects(name, implementation):
    """A unit and its optimizer state as torch creates them on a GPU (fake CUDA tensors: a
    device mix raises as on a GPU), packed as a transition sends it and unpacked as the
    receiving rank materialises it: every entry comes back on the device it left from.
    Adam without `fused` keeps its step count on the host ("Deliberately host `step` on
    CPU"): concatenating it with the device tensors failed at every first transition."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from pipetransformer.autodp.handoff import pack_unit, unpack_unit
    from pipetransformer.config import OptimizerConfig
    from pipetransformer.models import unit_param_names
    from pipetransformer.trainer import optim

    cuda = torch.device("cuda", 0)
    skeleton = tiny_bert(device="meta").units[1]
    with FakeTensorMode(allow_non_fake_inputs=True):
        unit = tiny_bert(device=cuda).units[1]  # layer 0's attention unit
        named = unit_param_names(unit, 1)
        config = OptimizerConfig(name=name, implementation=implementation)
        optimizer = optim.build_optimizer(config, named)
        for p in named.values():
            p.grad = torch.zeros_like(p)
        optimizer.step()
        states = optim.states_by_name(optimizer, named)
        packed = pack_unit(1, unit, states, cuda)
        received, received_states = unpack_unit(packed.manifest, packed.payload, skeleton, cuda)

        assert packed.payload.device == cuda
        assert all(p.device == cuda for p in received.parameters())
        assert received_states.keys() == states.keys()
        for key, state in states.items():
            assert received_states[key].keys() == state.keys()
            for entry, value in state.items():
                got = received_states[key][entry]
                assert (got.device, got.dtype, got.shape) == (
                    value.device,
                    value.dtype,
                    value.shape,
                )
        # ... and the next optimizer (rebuilt over the received parameters) takes it as is.
        rebuilt = optim.build_optimizer(config, unit_param_names(received, 1))
        optim.load_states_by_name(rebuilt, unit_param_names(received, 1), received_states)
        for p in received.parameters():
            for entry, value in rebuilt.state[p].items():
                assert value.device == (
                    torch.device("cpu") if entry == "step" and implementation != "fused" else cuda
                ), (entry, value.device)


# ----------------------------------------------------------------------------- devices


def test_more_processes_than_visible_gpus_is_one_line_naming_the_key(monkeypatch):
    """NCCL refuses two ranks on one GPU: refused before any worker starts, one line."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    result = run_cli("train", "configs/quickstart.yaml", "trainer.device=cuda")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "trainer.nproc_per_node: 2 processes per node but 1 visible GPU" in lines[0]
    assert "CUDA_VISIBLE_DEVICES=3" in lines[0]


def test_a_gpu_config_where_cuda_is_unusable_is_one_line(monkeypatch):
    """trainer.device: cuda on a machine without usable CUDA fails before any worker starts,
    instead of training on CPU processes."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = run_cli("train", "configs/vit_cifar100.yaml")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "trainer.device: 'cuda' but CUDA is unusable here" in lines[0]


def test_tf32_is_on_for_float32_on_cuda_unless_turned_off():
    from pipetransformer.trainer.distributed import configure_math

    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        configure_math(torch.device("cpu"), True)
        assert not torch.backends.cuda.matmul.allow_tf32
        configure_math(torch.device("cuda", 0), True)
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        configure_math(torch.device("cuda", 0), False)  # trainer.tf32=false
        assert not torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_a_gpu_machine_whose_cuda_is_unusable_says_why(monkeypatch):
    """trainer.device auto trained on CPU processes without a word when CUDA could not be
    used (a driver too old for the wheel, a container started without its GPUs)."""
    from pipetransformer.trainer import distributed

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.delenv("NVIDIA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(distributed.os.path, "exists", lambda path: False)
    assert distributed.cuda_unusable_reason() is None  # no sign of a GPU: nothing to say

    def too_old():
        raise RuntimeError("The NVIDIA driver on your system is too old (found version 11040)")

    monkeypatch.setattr(torch.cuda, "init", too_old)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert "driver on your system is too old" in distributed.cuda_unusable_reason()


def test_host_to_device_copies_come_from_pinned_memory(monkeypatch):
    """From pageable memory a copy to a GPU makes the host wait for the stream."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from pipetransformer.pipe.transfer import to_device

    pinned = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: pinned.append(self) or self)
    with FakeTensorMode(allow_non_fake_inputs=True):
        batch = torch.ones(4, 3)
        on_gpu = to_device(batch, torch.device("cuda", 0))
        assert on_gpu.device == torch.device("cuda", 0) and pinned == [batch]
        assert to_device(batch, torch.device("cpu")).device.type == "cpu" and len(pinned) == 1


# ----------------------------------------------------------------------------- timing


class FakeEvent:
    """torch.cuda.Event on a made-up device clock: records the clock, counts waits."""

    clock_ms = 0.0
    waits = 0

    def __init__(self, enable_timing: bool = False) -> None:
        self.at = None

    def record(self, stream=None) -> None:
        self.at = FakeEvent.clock_ms

    def synchronize(self) -> None:
        FakeEvent.waits += 1

    def elapsed_time(self, end) -> float:
        return end.at - self.at


def test_device_time_is_marked_with_cuda_events_and_read_only_when_asked(monkeypatch):
    """A host clock around an NCCL all-reduce or a CUDA step reads the enqueue time; events
    on the stream read the device's. Reading waits for the device: only in take()."""
    from pipetransformer.pipe.timing import IntervalTimer, union_seconds

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    FakeEvent.waits = 0
    timer = IntervalTimer(torch.device("cuda", 0))
    for start_ms, end_ms in [(0, 30), (10, 40), (100, 110)]:  # two overlapping buckets
        FakeEvent.clock_ms = start_ms
        start = timer.mark()
        FakeEvent.clock_ms = end_ms
        timer.add(start, timer.mark())
    assert FakeEvent.waits == 0 and timer.pending == 3
    assert timer.take() == pytest.approx(0.050)  # [0, 40] and [100, 110], in seconds
    assert FakeEvent.waits == 3 and timer.take() == 0.0
    assert union_seconds([(0.0, 1.0), (0.5, 2.0), (3.0, 3.5)]) == pytest.approx(2.5)


def test_the_ranks_agree_on_a_stop_about_once_a_second_not_every_step():
    from pipetransformer.trainer.stop_poll import steps_between_polls

    assert steps_between_polls(0.01, most=10) == 10  # capped by the step log's interval
    assert steps_between_polls(0.3, most=10) == 3
    assert steps_between_polls(5.0, most=10) == 1
    assert steps_between_polls(0.0, most=10) == 1


# ----------------------------------------------------------------------------- memory


def test_the_device_budget_leaves_out_context_nccl_and_fragmentation():
    from pipetransformer.planning import context

    total = 16 * 2**30
    nccl = context.NCCL_COMMUNICATORS_HELD * context.NCCL_COMMUNICATOR_BYTES
    estimated = context.usable_device_bytes(total)
    assert estimated == pytest.approx(
        (total - context.CUDA_CONTEXT_BYTES - nccl) / (1 + context.FRAGMENTATION_ALLOWANCE)
    )
    measured = context.usable_device_bytes(total, context_bytes=3 * 2**30)
    assert measured < estimated  # a larger measured context leaves less


def test_autocache_leaves_shared_memory_for_nccl():
    from pipetransformer.autocache.daemon import shm_capacity

    free = 8 * 2**30
    assert shm_capacity(free, 2 * 2**30, 0) == shm_capacity(free, 0, 0) - 2 * 2**30


# ----------------------------------------------------------------------------- configs

GPU_CONFIGS = sorted(
    path.name
    for path in (ROOT / "configs").glob("*.yaml")
    if load_config(path).trainer.nproc_per_node not in (None, 2)  # not the 2-process local ones
)


def test_the_gpu_configs_are_the_ones_expected():
    assert GPU_CONFIGS == [
        "bert_squad.yaml",
        "bert_sst2.yaml",
        "vit_cifar100.yaml",
        "vit_imagenet.yaml",
    ]


@pytest.mark.parametrize("name", GPU_CONFIGS)
def test_every_gpu_config_names_cuda_uses_tensor_cores_and_fits_its_devices(name, tmp_path):
    """A GPU config that said `auto` trained on CPU processes where CUDA was unusable, and
    fp32 without TF32 runs an A100/H100 at its FP32 rate. It must also start on the paper's
    GPUs (16 GiB Quadro RTX 5000, its node of 8): `plan --predict` refuses a run no pipeline
    of which fits."""
    config = load_config(ROOT / "configs" / name)
    assert config.trainer.device == "cuda"
    assert config.trainer.precision == "bf16" or config.trainer.tf32
    result = run_cli(
        "plan",
        f"configs/{name}",
        f"pipeline.profile_path={tmp_path / 'none.json'}",
        "--predict",
        "--nodes",
        "1",
        "--devices-per-node",
        str(config.nproc_per_node),
        "--device",
        "quadro-rtx-5000",
        "--intra-node",
        "pcie3-x16",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    budget = json.loads(result.stdout)["cluster"]["device_memory_bytes"]
    rows = json.loads(result.stdout)["rows"]
    assert rows and all(row["peak_bytes"] <= budget for row in rows)


# ----------------------------------------------------------------------------- whole steps


def _audit_config(kind: str, shared_data: Path) -> dict:
    """2 ranks: a 2-stage pipeline, then (frozen_after layers frozen) one stage x 2
    replicas served by AutoCache; AdamW; M measured ('auto'); BERT in bf16."""
    config = {
        "trainer": {
            "epochs": 1,
            "global_batch_size": 16,
            "nproc_per_node": 2,
            "device": "cpu",
            "progress_bar": False,
            "log_interval_steps": 1000,
            "precision": "bf16" if kind == "bert" else "fp32",
        },
        "optimizer": {"name": "adamw", "lr": 1e-3, "max_grad_norm": 1.0},
        "pipeline": {"initial_pipe_len": 2, "num_micro_batches": "measured", "balance": "params"},
        "freeze": {"strategy": "gradient_norm", "interval_steps": 1000},
        "cache": {"enabled": True, "profile": False},
    }
    if kind == "vit":
        config["model"] = {
            "name": "vit_tiny_patch16_224",
            "kwargs": {"patch_size": 4, "embed_dim": 32, "depth": 4, "num_heads": 2},
        }
        config["data"] = {"name": "digits", "image_size": 8, "train_subset": 160}
    else:
        config["model"] = {"name": "bert", "kwargs": dict(TINY_BERT_KWARGS)}
        config["data"] = {
            "name": "sst2",
            "root": str(shared_data / "sst2"),
            "max_seq_length": 16,
            "train_subset": 160,
            "eval_subset": 16,
        }
    return config


TINY_BERT_KWARGS = {
    "hidden_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "intermediate_size": 64,
}


@pytest.fixture(scope="module", params=["bert", "vit"])
def audited(request, tmp_path_factory):
    from conftest import SHARED_DATA
    from gpu_workers import audited_run
    from helpers import run_workers

    if request.param == "bert" and not SHARED_DATA.is_dir():
        pytest.skip(f"{SHARED_DATA} is not present")
    config = _audit_config(request.param, SHARED_DATA)
    run_dir = tmp_path_factory.mktemp(f"audited-{request.param}")
    # Frozen enough that the active layers pack into one stage (Eq. 2 on parameter sizes).
    return request.param, run_workers(audited_run, 2, config, str(run_dir), 3)


@pytest.mark.distributed
def test_a_step_reads_nothing_on_the_host_and_never_waits_for_a_copy(audited):
    """Whole training steps that log nothing, in a pipeline and in DDP after a transition,
    with the cache serving: no value reaches the host (.item(), bool(), if tensor), and no
    copy between host and device blocks. AdamW's step count is kept on the host by torch
    (reading it costs no synchronisation)."""
    kind, results = audited
    for rank, result in enumerate(results):
        layouts = [p["layout"] for p in result["phases"]]
        assert "pipe_len=2" in layouts[0] and "pipe_len=1" in layouts[1], layouts
        assert result["phases"][1]["cache_active"]
        for phase in result["phases"]:
            assert phase["host_reads"] == [], (kind, rank, phase["layout"], phase["host_reads"])
            assert phase["blocking"] == [], (kind, rank, phase["layout"], phase["blocking"])


@pytest.mark.distributed
def test_collectives_are_what_nccl_takes_and_every_rank_makes_the_same_groups(audited):
    kind, results = audited
    for result in results:
        assert result["violations"] == [], (kind, result["violations"])
        assert result["counts"].get("training:all_reduce", 0) > 0  # DDP ran in phase 2
        pipeline_p2p = ("training:send", "training:recv", "training:batch_isend_irecv")
        assert sum(result["counts"].get(op, 0) for op in pipeline_p2p) > 0  # and the pipeline
    assert results[0]["groups"] == results[1]["groups"] and results[0]["groups"]


@pytest.fixture(scope="module")
def audited_sharded(tmp_path_factory):
    """The BERT audit run (bf16) sharded from the start (FSDP2 over both ranks), then 3
    layers frozen: sharded again, the trained layers' shards carried, AutoCache serving."""
    from conftest import SHARED_DATA
    from gpu_workers import audited_run
    from helpers import run_workers

    if not SHARED_DATA.is_dir():
        pytest.skip(f"{SHARED_DATA} is not present")
    config = _audit_config("bert", SHARED_DATA)
    config["pipeline"].update(initial_pipe_len=1, sharding="always")
    run_dir = tmp_path_factory.mktemp("audited-sharded")
    return run_workers(audited_run, 2, config, str(run_dir), 3)


@pytest.mark.distributed
def test_an_fsdp2_step_reads_nothing_on_the_host_and_gathers_in_nccl_dtypes(audited_sharded):
    """FSDP2's all-gathers and reduce-scatters on the training (data) group, in bfloat16 and
    float32, the shards' squared gradient norms summed over it in float64; no host read or
    blocking copy in a step, before and after a transition between sharded layouts."""
    for rank, result in enumerate(audited_sharded):
        layouts = [p["layout"] for p in result["phases"]]
        assert all("sharded" in layout for layout in layouts), layouts
        assert "frozen_layers=3" in layouts[1] and result["phases"][1]["cache_active"]
        for phase in result["phases"]:
            assert phase["host_reads"] == [], (rank, phase["layout"], phase["host_reads"])
            assert phase["blocking"] == [], (rank, phase["layout"], phase["blocking"])
        assert result["violations"] == [], result["violations"]
        counts = result["counts"]
        assert counts.get("training:all_gather_single", 0) > 0, counts
        assert counts.get("training:reduce_scatter_single", 0) > 0, counts
        assert counts.get("training:all_reduce", 0) > 0, counts  # the gradient norms
    assert audited_sharded[0]["groups"] == audited_sharded[1]["groups"]


@pytest.mark.distributed
def test_micro_batch_trials_are_released_once_m_is_chosen(audited):
    """Each candidate M built a DDP + PipelineStage: none may outlive the choice (with the
    collector off: reference counting alone must free them)."""
    kind, results = audited
    for result in results:
        assert result["trials_built"] >= 3  # trials and the real runtimes of two layouts
        assert result["trials_alive"] == [0, 0], (kind, result["trials_alive"])


@pytest.mark.distributed
def test_autocast_copies_each_weight_once_a_step_not_once_a_micro_batch(audited):
    kind, results = audited
    if kind != "bert":
        pytest.skip("the ViT run is float32")
    pipeline = [r["phases"][0] for r in results]
    assert all(p["num_micro_batches"] >= 2 for p in pipeline)
    # Stage 0 holds only the embedding (nothing autocast copies); stage 1 the layers.
    assert max(p["most_casts_of_a_weight"] for p in pipeline) == 1, pipeline
