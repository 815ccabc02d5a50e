"""A GPU's rules, enforced on this CPU (the `gpu_rules` marker is the contract; docs/gpus.md
says what each test stands for and what only a GPU can show)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from families import FAMILIES, TEXT_FAMILIES, batch, text_batch
from gpu_audit import FakeCudaStreams, HostReads, collective_order_problem
from helpers import ROOT, run_cli, tiny_bert, tiny_vit

from pipetransformer.config import load_config

pytestmark = pytest.mark.gpu_rules

CASES = [(name, "padded") for name in FAMILIES]
CASES += [(name, padding) for name in TEXT_FAMILIES for padding in ("unpadded", "packed")]


def packed_batch():
    """The text batch packed (data.padding packed) as one micro-batch: its rows, segment
    ids and sample starts."""
    from pipetransformer.data.base import real_lengths
    from pipetransformer.utils.packing import Packing
    from pipetransformer.utils.padding import packed_shape

    inputs = text_batch(6)
    lengths = real_lengths(inputs[-1])
    return Packing(lengths, packed_shape(lengths, 6, 16, False)).inputs(inputs)


def inputs_of(family, padding: str):
    if not family.text or padding == "padded":
        return batch(family)
    return text_batch(padded=False) if padding == "unpadded" else packed_batch()


@pytest.mark.parametrize("name, padding", CASES, ids=lambda v: str(v))
def test_a_forward_and_backward_read_nothing_on_the_host(name, padding):
    """Every unit forward and backward, train mode, every family: no value reaches the host.
    transformers' bidirectional masks read `padding_mask.all()` unless told not to (one
    read per attention unit per micro-batch on a GPU); a packed batch's positions, masks
    and heads are made on the device from its segment ids and sample starts."""
    family = FAMILIES[name]
    model = family.build(dropout=True).train()
    inputs = inputs_of(family, padding)
    with HostReads() as audit:
        out = model(*inputs)
        out.float().sum().backward()
    assert audit.reads == []


@pytest.mark.parametrize(
    "name, padding",
    [(name, "padded") for name in FAMILIES] + [(n, "packed") for n in TEXT_FAMILIES],
)
def test_a_forward_on_a_gpu_copies_nothing_between_host_and_device(name, padding, monkeypatch):
    """Every unit's forward, library code included, on fake CUDA tensors (the devices a GPU
    run has), seen at the operator level (`DeviceCopies`): no blocking copy between host and
    device. DeBERTa's attention units called transformers' `build_relative_position`, whose
    `torch.tensor(mid - 1).type_as(positions)` copied a host scalar to the device in every
    attention unit (4 a forward here); the positions are now made once per length and
    device, on the device. The package-only audit (`BlockingTransfers`) did not see it.
    Packed batches through the dense mask (the CPU's path, and a compiled unit's without
    flash-attention): fake tensors cannot make nested ones; the variable-length path on
    CUDA is audited in tests/test_gpu_path.py, up to a stand-in kernel."""
    from gpu_audit import DeviceCopies
    from torch._subclasses.fake_tensor import FakeTensorMode

    from pipetransformer.models import packed as packing

    monkeypatch.setattr(packing, "use_varlen", lambda hidden: False)

    family = FAMILIES[name]
    model = family.build(dropout=True).train()
    inputs = inputs_of(family, padding)
    cuda = torch.device("cuda", 0)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to(cuda)
        on_device = [t.to(cuda) for t in inputs]
        for _ in range(2):  # the first forward and one that finds what it made before
            with DeviceCopies() as audit:
                out = model(*on_device)
            assert audit.found == [], audit.found
    assert out.device == cuda


def test_debertas_positions_made_once_are_transformers_own():
    """`RelativePositions` against transformers' `build_relative_position` at DeBERTa-v3's
    settings (256 buckets over 512 positions) and the test size's, for several lengths:
    equal, and one tensor per length and device."""
    from transformers.models.deberta_v2.modeling_deberta_v2 import build_relative_position

    from pipetransformer.models.deberta import RelativePositions

    for buckets, most in ((256, 512), (8, 16), (-1, -1)):
        positions = RelativePositions(buckets, most)
        for length in (7, 128, 512):
            hidden = torch.zeros(1, length, 4)
            expected = build_relative_position(hidden, hidden, buckets, most)
            assert torch.equal(positions(length, hidden.device), expected), (buckets, length)
            assert positions(length, hidden.device) is positions(length, hidden.device)


# Adam keeps AdamW's state; fused SGD has no fake kernel (torch 2.14) and a device step like
# fused AdamW's.
SYNCING = {
    "item": lambda x, m: x.sum().item(),
    "bool": lambda x, m: bool(x.sum() > 0),
    "mask indexing": lambda x, m: x[m],
    "nonzero": lambda x, m: m.nonzero(),
    "where(cond)": lambda x, m: torch.where(m),
    "masked_select": lambda x, m: x.masked_select(m),
    "unique": lambda x, m: torch.unique(x.round()),
    "unique_consecutive": lambda x, m: torch.unique_consecutive(m),
    "repeat_interleave": lambda x, m: torch.arange(4).repeat_interleave(m.long()),
    "bincount": lambda x, m: m.long().bincount(),
}
NOT_SYNCING = {
    "index by positions": lambda x, m: x[torch.tensor([0, 2])],
    "where(cond, a, b)": lambda x, m: torch.where(m, x, 0.0),
    "masked_fill": lambda x, m: x.masked_fill(m, 0.0),
    "repeat_interleave, sized": lambda x, m: torch.arange(4).repeat_interleave(
        m.long(), output_size=2
    ),
}


def test_the_host_read_audit_counts_every_op_that_waits_for_the_device():
    """On CUDA an op whose output size depends on values (a mask's count of True) copies
    that count to the host and waits for the stream, as `.item()` does."""
    x = torch.tensor([0.5, -1.0, 2.0, 3.0])
    m = x > 1
    for name, op in {**SYNCING, **NOT_SYNCING}.items():
        with HostReads() as audit:
            op(x, m)
        assert bool(audit.reads) == (name in SYNCING), (name, audit.reads)


OPTIMIZERS = [("sgd", "foreach"), ("adamw", "foreach"), ("adamw", "fused")]


@pytest.mark.parametrize("family_name", FAMILIES)
def test_the_state_handoff_keeps_every_entry_on_the_device_torch_expects(family_name):
    """Every unit of the family and its optimizer state as torch creates them on a GPU, with
    each optimizer implementation (fake CUDA tensors: a device mix raises as on a GPU, and so
    does a misaligned view), packed as a transition sends it and unpacked as the receiving
    rank materialises it: every entry comes back on the device it left from, bit-exact.
    Adam without `fused` keeps its step count on the host ("Deliberately host `step` on
    CPU"): concatenating it with the device tensors failed at every first transition. Fused
    Adam's step is a 4-byte device tensor: an int64 buffer after it (BEiT's
    `relative_position_index`, BERT's `position_ids`) was viewed at an offset not divisible
    by 8 ("storage_offset() must be divisible by 8")."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from pipetransformer.autodp.handoff import pack_unit, unpack_unit
    from pipetransformer.config import OptimizerConfig
    from pipetransformer.models import unit_param_names
    from pipetransformer.trainer import optim

    family = FAMILIES[family_name]
    cuda = torch.device("cuda", 0)
    sent, seen = [], set()
    for index, unit in enumerate(family.build(device="meta").units):
        signature = tuple((n, t.shape, t.dtype) for n, t in unit.state_dict().items())
        if signature not in seen:  # layers alike pack alike: the first of each stands for all
            seen.add(signature)
            sent.append((index, unit))
    skeletons = {i: [copy.deepcopy(u) for _ in OPTIMIZERS] for i, u in sent}  # one a receive
    with FakeTensorMode(allow_non_fake_inputs=True):
        for index, unit in sent:
            unit.to_empty(device=cuda)  # values are never read
            named = unit_param_names(unit, index)
            for (name, implementation), skeleton in zip(OPTIMIZERS, skeletons[index]):
                config = OptimizerConfig(name=name, implementation=implementation)
                optimizer = optim.build_optimizer(config, named)
                for p in named.values():
                    p.grad = torch.zeros_like(p)
                optimizer.step()
                states = optim.states_by_name(optimizer, named)
                packed = pack_unit(index, unit, states, cuda)
                received, received_states = unpack_unit(
                    packed.manifest, packed.payload, skeleton, cuda
                )
                where = (family_name, index, name, implementation)
                assert packed.payload.device == cuda, where
                assert all(t.device == cuda for t in received.state_dict().values()), where
                assert received_states.keys() == states.keys(), where
                for key, state in states.items():
                    assert received_states[key].keys() == state.keys(), where
                    for entry, value in state.items():
                        got = received_states[key][entry]
                        assert (got.device, got.dtype, got.shape) == (
                            value.device,
                            value.dtype,
                            value.shape,
                        ), (*where, key, entry)
                # ... and the next optimizer (over the received parameters) takes it as is.
                received_named = unit_param_names(received, index)
                rebuilt = optim.build_optimizer(config, received_named)
                optim.load_states_by_name(rebuilt, received_named, received_states)
                host_step = name != "sgd" and implementation != "fused"
                for p in received.parameters():
                    for entry, value in rebuilt.state[p].items():
                        expected = torch.device("cpu") if entry == "step" and host_step else cuda
                        assert value.device == expected, (*where, entry, value.device)


def test_the_handoff_is_bit_exact_with_entries_of_every_alignment():
    """Real tensors: a 4-byte step, an odd-sized int8 buffer and an int64 buffer after
    them, each entry back with its own bits and each view of the buffer aligned."""
    from torch import nn

    from pipetransformer.autodp.handoff import ENTRY_ALIGNMENT, pack_unit, unpack_unit

    def unit(device="cpu") -> nn.Module:
        module = nn.Linear(3, 1, device=device)
        module.register_buffer("flags", torch.arange(3, dtype=torch.int8, device=device))
        module.register_buffer("index", torch.arange(5, device=device) * 2**40)
        return module

    sent = unit()
    states = {"units.2.weight": {"step": torch.tensor(7.0), "exp_avg": torch.randn(1, 3)}}
    packed = pack_unit(2, sent, states, torch.device("cpu"))
    received, received_states = unpack_unit(
        packed.manifest, packed.payload, unit("meta"), torch.device("cpu")
    )
    for name, value in sent.state_dict().items():
        got = received.state_dict()[name]
        assert torch.equal(got, value) and got.storage_offset() == 0, name
    for entry, value in states["units.2.weight"].items():
        assert torch.equal(received_states["units.2.weight"][entry], value), entry
    assert ENTRY_ALIGNMENT % torch.int64.itemsize == 0


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


def test_bf16_on_a_gpu_without_it_is_one_line_naming_the_key(monkeypatch):
    """The paper's Quadro RTX 5000 (Turing, compute capability 7.5) has no bfloat16."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Quadro RTX 5000")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    base = ("train", "configs/quickstart.yaml", "trainer.device=cuda")
    result = run_cli(*base, "trainer.precision=bf16")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "trainer.precision: bf16 but Quadro RTX 5000 (compute capability 7.5)" in lines[0]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    from pipetransformer.cli.preflight import check_devices

    check_devices(
        load_config(
            ROOT / "configs" / "quickstart.yaml", list(base[2:]) + ["trainer.precision=bf16"]
        )
    )


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


def test_the_trainers_start_up_sets_tf32_as_trainer_tf32_says(monkeypatch, tmp_path):
    """The start-up itself, not the helper: `Trainer.setup` hands `trainer.tf32` to
    `init_distributed`, which sets TF32 on the CUDA device it picks (CUDA faked, the
    process group taken as made). Dropping either call left float32 matmuls at the FP32
    rate with the helper's own test still passing."""
    from pipetransformer.trainer import distributed
    from pipetransformer.trainer import trainer as trainer_module

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: True)
    for name, value in dict(RANK=1, WORLD_SIZE=2, LOCAL_RANK=1, LOCAL_WORLD_SIZE=2).items():
        monkeypatch.setenv(name, str(value))
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # restored after
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        for tf32 in (True, False):
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = not tf32
            world = distributed.init_distributed("cuda", 10.0, tf32)
            assert world.device == torch.device("cuda", 1)
            assert torch.backends.cuda.matmul.allow_tf32 is tf32
            assert torch.backends.cudnn.allow_tf32 is tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved

    handed = []

    def started(device_kind, timeout_s, tf32=True):
        handed.append(tf32)
        raise InterruptedError  # nothing after the start-up is needed

    monkeypatch.setattr(trainer_module, "init_distributed", started)
    for tf32 in ("true", "false"):
        config = load_config(ROOT / "configs" / "quickstart.yaml", [f"trainer.tf32={tf32}"])
        with pytest.raises(InterruptedError):
            trainer_module.Trainer(config, tmp_path).setup()
    assert handed == [True, False]


class _DecodedDataset:
    """A dataset the loaders decode (not in-memory tensors): they start workers for it."""

    def __len__(self) -> int:
        return 8

    def fetch(self, ids):
        return (torch.zeros(len(ids), 3),), torch.zeros(len(ids), dtype=torch.long)


@pytest.mark.parametrize("overrides", [[], ["trainer.precision=bf16"], ["trainer.tf32=false"]])
def test_the_peers_compute_with_the_trainers_settings(overrides, monkeypatch, tmp_path):
    """For the same config on a (faked) GPU node of 8 processes and 16 cores, rank 3: the
    peers' device, TF32, autocast dtype, pinned memory and loader workers are what the
    trainer's start-up (`init_distributed`) and its loaders set. The torch_ddp peer ignored
    trainer.precision, set no device and no TF32, decoded on the main thread and copied from
    pageable memory; the hf_trainer peer left TrainingArguments' tf32 unset (off) and started
    all of data.num_workers on every rank. (tests/test_peers.py runs both peers audited.)"""
    pytest.importorskip("accelerate")  # transformers' Trainer needs it (the .[peers] extra)
    import os

    import transformers

    from pipetransformer.compare import peers
    from pipetransformer.trainer import distributed
    from pipetransformer.trainer.step import Batches

    devices = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: devices.append(device))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    for name, value in dict(RANK=3, WORLD_SIZE=8, LOCAL_RANK=3, LOCAL_WORLD_SIZE=8).items():
        monkeypatch.setenv(name, str(value))
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # restored after
    text = ["model.name=bert", "model.model_name_or_path=null", "data.num_workers=8"]
    config = load_config(ROOT / "configs" / "bert_sst2.yaml", text + overrides)
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        unset = not config.trainer.tf32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = unset
        world = distributed.init_distributed(config.trainer.device, 10.0, config.trainer.tf32)
        trainer_tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        data = type("Data", (), {"train": _DecodedDataset()})()
        batches = Batches(config, data, None, None, world, tmp_path, None)
        trainer_loader = batches._batch_loader._loader

        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = unset
        devices.clear()
        compute = peers.peer_math(config)
        compute.enter()
        assert devices == [world.device] == [compute.device]
        assert (
            (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
            == (trainer_tf32)
            == (config.trainer.tf32,) * 2
        )
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
    name = config.trainer.autocast_dtype  # what the trainer's runtimes autocast to
    assert compute.autocast_dtype == (getattr(torch, name) if name else None)
    assert compute.pin_memory and trainer_loader.pin_memory
    assert compute.loader_workers == trainer_loader.num_workers == 1  # 16 cores / 8, less one

    class Stop(Exception):
        pass

    def arguments(**kwargs):
        raise Stop(kwargs)

    monkeypatch.setattr(transformers, "TrainingArguments", arguments)
    bundle = type("Data", (), {"task": "classification", "num_classes": 2, "vocab_size": 50})()
    with pytest.raises(Stop) as stopped:
        peers._run_hf_trainer(config, bundle, tmp_path, 8, "adamw_torch")
    hf = stopped.value.args[0]
    assert (hf["tf32"], hf["bf16"]) == (config.trainer.tf32, compute.autocast_dtype is not None)
    assert hf["dataloader_pin_memory"] and hf["dataloader_num_workers"] == 1
    assert (hf["use_cpu"], hf["ddp_backend"]) == (False, "nccl")


_FIRST_CUDA_INIT = """
import json, sys
import torch

seen = []


class Initialised(Exception):
    pass


def first_initialisation(*args, **kwargs):
    # What the caching allocator reads when CUDA initialises: its settings, parsed once.
    seen.append(torch._C._accelerator_getAllocatorSettings())
    raise Initialised


torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 2
torch.cuda._lazy_init = torch.cuda.init = first_initialisation
from pipetransformer.cli import main

try:
    main(sys.argv[1:])
except Initialised:
    pass
print(json.dumps(seen))
"""


@pytest.mark.slow
def test_expandable_segments_are_on_before_cuda_first_initialises_under_torchrun(tmp_path):
    """Slow: about 9 s (a fresh interpreter importing the package). A torchrun worker's
    start-up (`pipetransformer train` with torchrun's environment, a fresh interpreter, CUDA
    faked) up to the first call that initialises CUDA: the caching
    allocator's own settings (it parses them once, at that moment) have expandable segments.
    The preflight's `get_device_capability` initialised CUDA before `init_distributed` set
    PYTORCH_CUDA_ALLOC_CONF, so every torchrun run had them off (the memory model's 5%
    fragmentation allowance assumes them on). A setting the user made is kept."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.endswith("ALLOC_CONF")}
    env.update(
        RANK="0",
        WORLD_SIZE="2",
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="2",
        TORCHELASTIC_RUN_ID="allocator",
        PYTHONPATH=str(ROOT),
    )
    command = [sys.executable, "-c", _FIRST_CUDA_INIT, "train", "configs/quickstart.yaml"]
    command += ["trainer.device=cuda", "--run-dir", str(tmp_path / "run")]
    for user_setting in (None, "expandable_segments:False"):
        if user_setting is not None:
            env["PYTORCH_ALLOC_CONF"] = user_setting
        result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
        assert result.returncode == 0, result.stderr[-2000:]
        expected = user_setting or "expandable_segments:True"
        assert json.loads(result.stdout.strip().splitlines()[-1]) == [expected], result.stdout


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


@pytest.mark.parametrize(
    ("nccl", "gloo"),
    [
        ("=ib0", "ib0"),  # one exact name: gloo's too
        ("ib", "ib0"),  # a prefix: the first interface it admits
        ("^docker0,lo", "eth0"),  # exclusions: the first interface they leave
        ("=eth1,eth0", "eth0"),  # exact names, none of them routed: the first present
        ("eth0", "eth0"),  # a prefix that is also a name
        ("bond", None),  # admits no interface here: gloo picks (and a warning says so)
    ],
)
def test_the_multi_node_launcher_gives_gloo_an_exact_interface(nccl, gloo, tmp_path):
    """NCCL_SOCKET_IFNAME takes prefixes and exclusions, gloo an exact interface name: the
    launcher copied NCCL's setting, so `^docker0,lo` or `eth` left the control group unable
    to start. Run on a host with interfaces lo, docker0, eth0, ib0, ib1 (SYSFS_NET) and a
    master routed through none of them."""
    import os
    import subprocess

    for name in ("lo", "docker0", "eth0", "ib0", "ib1"):
        (tmp_path / name).mkdir()
    env = {k: v for k, v in os.environ.items() if not k.endswith("SOCKET_IFNAME")}
    env.update(
        NNODES="2",
        NODE_RANK="0",
        NPROC_PER_NODE="8",
        MASTER_ADDR="node0.invalid",  # no route: the interfaces listed decide
        DRY_RUN="1",
        SYSFS_NET=str(tmp_path),
        NCCL_SOCKET_IFNAME=nccl,
    )
    result = subprocess.run(
        ["bash", str(ROOT / "launch" / "run_multi_node.sh"), "configs/vit_imagenet.yaml"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert f"GLOO_SOCKET_IFNAME={gloo or ''}" in result.stdout.split(), result.stdout
    assert ("admits no interface" in result.stderr) == (gloo is None), result.stderr


def test_the_launch_scripts_count_the_gpus_torch_sees(tmp_path):
    """On a host whose `nvidia-smi -L` lists 8 GPUs and 2 MIG instances, a process that sees
    3 of them (CUDA_VISIBLE_DEVICES) starts 3 workers a node, and one that sees none the
    single-node script's CPU default (the multi-node script asks for NPROC_PER_NODE). torch
    is a stand-in here (a sitecustomize module counting CUDA_VISIBLE_DEVICES, without the
    seconds of importing torch); the scripts call `torch.cuda.device_count()`. They counted
    nvidia-smi's lines: 10 workers, two ranks on a GPU."""
    import os
    import stat
    import subprocess
    import sys

    bin_dir, site = tmp_path / "bin", tmp_path / "site"
    bin_dir.mkdir()
    site.mkdir()
    smi = bin_dir / "nvidia-smi"
    lines = [f"GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i})" for i in range(8)]
    lines += [f"  MIG 3g.40gb     Device  {i}: (UUID: MIG-{i})" for i in range(2)]
    smi.write_text("#!/bin/sh\ncat <<'EOF'\n" + "\n".join(lines) + "\nEOF\n")
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    (site / "sitecustomize.py").write_text(
        "import os, sys, types\n"
        "visible = [d for d in os.environ.get('CUDA_VISIBLE_DEVICES', '').split(',') if d]\n"
        "torch = types.ModuleType('torch')\n"
        "torch.cuda = types.SimpleNamespace(\n"
        "    is_available=lambda: bool(visible), device_count=lambda: len(visible))\n"
        "sys.modules['torch'] = torch\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "NPROC_PER_NODE"}
    env.update(
        PATH=f"{bin_dir}:{env['PATH']}",
        PYTHON=sys.executable,
        PYTHONPATH=str(site),
        DRY_RUN="1",
        NNODES="1",
        NODE_RANK="0",
        MASTER_ADDR="127.0.0.1",
    )
    for script in ("run_single_node.sh", "run_multi_node.sh"):
        command = ["bash", str(ROOT / "launch" / script), "configs/quickstart.yaml"]
        for visible, expected in (("0,1,2", 3), ("", 2)):
            env["CUDA_VISIBLE_DEVICES"] = visible
            result = subprocess.run(command, capture_output=True, text=True, env=env)
            if script == "run_multi_node.sh" and not visible:
                assert result.returncode == 2 and "set NPROC_PER_NODE" in result.stderr, result
                continue
            assert result.returncode == 0, result.stderr
            assert f"--nproc-per-node {expected} " in result.stdout, (script, result.stdout)


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


class _LoopRun:
    """The trainer's own loop (`Trainer.train`) with its clock (`StepClock`), step runner
    (`StepRunner`, on a CUDA device whose events are FakeEvents) and stop poll (`StopPoll`);
    the rest stubbed. Each step takes STEP_S of a made-up host clock, and a one-layer model
    is trained on the CPU."""

    STEP_S = 0.25

    def __init__(self, monkeypatch, stop_after: int | None = None) -> None:
        from types import SimpleNamespace

        from pipetransformer.autodp.control import Control
        from pipetransformer.autodp.sampler import TrainSampler
        from pipetransformer.runs.state import RunState
        from pipetransformer.trainer import stop_poll
        from pipetransformer.trainer.clock import StepClock
        from pipetransformer.trainer.distributed import WorldInfo
        from pipetransformer.trainer.step import Stage, StepData, StepRunner
        from pipetransformer.trainer.trainer import Trainer
        from pipetransformer.utils.stopping import StopRequest

        monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
        FakeEvent.waits, FakeEvent.clock_ms = 0, 0.0
        self.now = 0.0
        monkeypatch.setattr(stop_poll, "time", SimpleNamespace(perf_counter=lambda: self.now))
        self.polls, self.results, self.saved = [], [], []
        loop = self

        class CountingControl(Control):
            def all_max(self, values):
                loop.polls.append(loop.trainer.state.global_step)
                return super().all_max(values)

        config = load_config(ROOT / "configs" / "quickstart.yaml")
        model = torch.nn.Linear(4, 2)
        self.stop = StopRequest()
        self.stop_after = stop_after

        def train_step(inputs, target, ids, seq_length=None):
            self.now += self.STEP_S
            FakeEvent.clock_ms = 1000 * self.now
            if len(self.results) + 1 == self.stop_after:
                self.stop.signum = 15  # SIGTERM arrives during this step
            return [torch.nn.functional.cross_entropy(model(inputs[0]), target)]

        runtime = SimpleNamespace(is_first=True, train_step=train_step)
        batch = StepData(
            [torch.randn(8, 4)], torch.zeros(8, dtype=torch.long), tuple(range(8)), None
        )
        sampler = TrainSampler(8 * 30, 1, 8, 0)  # 30 steps an epoch
        batches = SimpleNamespace(
            sampler=sampler, step_data=lambda *a, **kw: batch, padded_tokens=lambda *a: 0
        )
        world = WorldInfo(0, 1, 0, 1, torch.device("cuda", 0))
        layout = SimpleNamespace(dp_degree=1, sharded=False, pipe_len=1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        trainer = self.trainer = Trainer.__new__(Trainer)
        trainer.config, trainer.state, trainer.stop = config, RunState(), self.stop
        trainer.clock = StepClock(trainer.state, sampler, epochs=2, replicas_per_node=1)
        trainer.steps = StepRunner(config, batches, world, num_units=1, grad_norms=False)
        trainer.stage = Stage(layout, None, {0: model}, optimizer, runtime, False)
        trainer.stop_poll = stop_poll.StopPoll(CountingControl(None), self.stop, most_steps=10)
        trainer.metrics = SimpleNamespace(
            record=lambda tick, result: self.results.append(result), due=lambda tick: False
        )
        trainer.reporter = SimpleNamespace(event=lambda event: None)
        trainer.freezer = SimpleNamespace(due=lambda tick: False)
        trainer.checkpointer = SimpleNamespace(due=lambda tick: False, last_path="checkpoint")
        trainer._start_event = lambda: SimpleNamespace(decided_by_measured_time=())
        trainer.training_clock = SimpleNamespace(start=lambda: None)
        trainer._evaluate = lambda tick: None
        trainer._finish = lambda: "finished"
        trainer.save_checkpoint = lambda tick, reason, metric=None: self.saved.append(
            (tick.global_step, reason)
        )
        assert config.optimizer.max_grad_norm is None  # no gradient norms to take


def test_the_trainers_loop_marks_steps_on_the_device_and_polls_about_once_a_second(
    monkeypatch,
):
    """The trainer's loop, not the helpers: each step is marked by CUDA events on the
    stream that nothing waits for in the loop (a host clock reads the enqueue time), and
    the ranks agree on a stop about every second of steps, at most 10 steps apart and at
    every epoch end, not at every step (a cross-node barrier each)."""
    from pipetransformer.utils.stopping import RunStopped

    run = _LoopRun(monkeypatch)
    assert run.trainer.train() == "finished"
    assert len(run.results) == 60 and FakeEvent.waits == 0
    for step, result in enumerate(run.results, 1):
        start, end = result.marks
        assert isinstance(start, FakeEvent) and isinstance(end, FakeEvent), result.marks
        assert end.at - start.at == pytest.approx(1000 * run.STEP_S), step  # the step's span
    # 0.25 s a step: a poll every 4 steps (about a second), and at each epoch's last step.
    assert 30 in run.polls and 60 in run.polls
    assert len(run.polls) <= 60 // 4 + 2, run.polls
    assert max(b - a for a, b in zip([0, *run.polls], run.polls)) <= 4, run.polls

    stopped = _LoopRun(monkeypatch, stop_after=7)  # a signal during step 7
    with pytest.raises(RunStopped) as raised:
        stopped.trainer.train()
    assert 7 <= raised.value.global_step <= 7 + 4, stopped.polls  # within about a second
    assert stopped.saved == [(raised.value.global_step, "SIGTERM")]


def test_ddps_communication_hook_marks_the_device_not_the_host(monkeypatch):
    """The DDP communication hook the stage runtime registers (`CommTimer`): a bucket's
    all-reduce is marked from the bucket being ready to its reduced gradients being back
    by events on the stream, read only when the trainer asks (the NCCL future completes at
    the enqueue: a host clock read about zero)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from pipetransformer.pipe.runtime import CommTimer
    from pipetransformer.pipe.timing import IntervalTimer

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    FakeEvent.waits = 0
    reduced = []
    monkeypatch.setattr(
        default_hooks,
        "allreduce_hook",
        lambda group, bucket: reduced.append(torch.futures.Future()) or reduced[-1],
    )
    timer = IntervalTimer(torch.device("cuda", 0))
    hook = CommTimer(timer)
    done = []
    for ready_ms, back_ms in [(5, 25), (20, 45)]:  # two buckets, overlapping on the stream
        FakeEvent.clock_ms = ready_ms
        done.append(hook.hook(None, None))
        FakeEvent.clock_ms = back_ms
        reduced[-1].set_result(torch.ones(2))
    assert all(torch.equal(future.wait(), torch.ones(2)) for future in done)
    assert timer.pending == 2 and FakeEvent.waits == 0  # nothing read in the step
    assert timer.take() == pytest.approx(0.040)  # [5, 45] ms
    assert FakeEvent.waits == 2


def _runner_and_stage(units: dict, train_step, grad_norms: bool = True):
    """A StepRunner on the CPU over `units` (SGD), its data and runtime stubbed."""
    from types import SimpleNamespace

    from pipetransformer.trainer.distributed import WorldInfo
    from pipetransformer.trainer.step import Stage, StepData, StepRunner

    config = load_config(ROOT / "configs" / "quickstart.yaml")
    batch = StepData([torch.randn(8, 4)], torch.zeros(8, dtype=torch.long), tuple(range(8)), None)
    sampler = SimpleNamespace(global_num_valid=lambda epoch, step: 8)
    batches = SimpleNamespace(
        sampler=sampler, step_data=lambda *a, **kw: batch, padded_tokens=lambda *a: 0
    )
    world = WorldInfo(0, 1, 0, 1, torch.device("cpu"))
    runner = StepRunner(config, batches, world, num_units=len(units), grad_norms=grad_norms)
    layout = SimpleNamespace(dp_degree=1, sharded=False, pipe_len=1)
    parameters = [p for unit in units.values() for p in unit.parameters()]
    runtime = SimpleNamespace(is_first=True, train_step=train_step)
    stage = Stage(layout, None, units, torch.optim.SGD(parameters, lr=0.1), runtime, False)
    return runner, stage


def test_the_gradient_norms_owner_index_goes_to_the_device_once_a_layout(monkeypatch):
    """Which unit each gradient belongs to was built, pinned and copied to the device at
    every step; it is the same for every step of a layout. Each unit's squared gradient
    norm still matches its gradients, also at a step that leaves a unit without any."""
    from pipetransformer.trainer import step as step_module
    from pipetransformer.trainer.clock import Tick

    copies = []
    copy = step_module.to_device
    monkeypatch.setattr(
        step_module, "to_device", lambda t, device: copies.append(t.tolist()) or copy(t, device)
    )
    units = {0: torch.nn.Linear(4, 4), 1: torch.nn.Linear(4, 2), 2: torch.nn.Linear(2, 2)}
    expected = []

    def train_step(inputs, target, ids, seq_length=None):
        x = units[1](units[0](inputs[0]))
        if len(expected) % 2 == 0:  # unit 2 is used every other step
            x = units[2](x)
        loss = torch.nn.functional.cross_entropy(x, target)
        loss.backward()
        expected.append(
            [
                sum(float(p.grad.square().sum()) for p in u.parameters() if p.grad is not None)
                for u in units.values()
            ]
        )
        return [loss]

    runner, stage = _runner_and_stage(units, train_step)
    for step in range(4):
        result = runner.run(Tick(0, step, step + 1, 4, 1, float(step), 4), stage)
        assert result.unit_grad_sq.tolist() == pytest.approx(expected[-1], rel=1e-5), step
    assert expected[1][2] == 0.0 and expected[0][2] > 0
    # The owner index once; then, at the steps without unit 2, only which gradients are there.
    assert copies[0] == [0, 0, 1, 1, 2, 2] and len(copies) == 1 + 2, copies
    assert copies[1:] == [[0, 1, 2, 3]] * 2, copies


def test_an_evaluation_reads_the_device_once_not_once_a_batch():
    """The classification metrics were read on the host three times per eval batch
    (correct, count, loss: each waits for the device); they are summed on the device and
    read once per evaluation. The trainer's Evaluator over 3 and 7 batches (the last one
    padded), a linear model on the CPU: the same reads, and the metrics of the whole set."""
    from types import SimpleNamespace

    from gpu_audit import BlockingTransfers

    from pipetransformer.autodp.control import Control
    from pipetransformer.autodp.topology import Role
    from pipetransformer.data import DataBundle
    from pipetransformer.data.base import TensorSampleDataset
    from pipetransformer.runs.state import RunState
    from pipetransformer.tasks import task_for
    from pipetransformer.trainer.distributed import WorldInfo
    from pipetransformer.trainer.evaluation import Evaluator
    from pipetransformer.trainer.step import Stage

    config = load_config(ROOT / "configs" / "quickstart.yaml")  # 64 samples a batch
    model = torch.nn.Linear(4, 2)
    world = WorldInfo(0, 1, 0, 1, torch.device("cpu"))
    runtime = SimpleNamespace(eval_step=lambda inputs, target, ids, length: model(inputs[0]))
    layout = SimpleNamespace(dp_degree=1, role=lambda rank: Role(0, 0, 1))
    stage = Stage(layout, None, {}, None, runtime, False)
    reads = []
    for samples in (64 * 2 + 10, 64 * 6 + 10):
        g = torch.Generator().manual_seed(samples)
        x, y = torch.randn(samples, 4, generator=g), torch.randint(0, 2, (samples,), generator=g)
        split = TensorSampleDataset([x], y)
        data = DataBundle(train=split, eval=split, task="classification", num_classes=2)
        task = task_for("classification")
        evaluator = Evaluator(config, data, task, world, Control(None), None, RunState())
        with torch.no_grad(), HostReads() as host, BlockingTransfers() as copies:
            result, _ = evaluator.evaluate(stage)
        reads.append(len(host.reads) + len(copies.found))
        with torch.no_grad():
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits, y).item()
        assert result.eval_samples == samples
        assert result.eval_metric == pytest.approx((logits.argmax(-1) == y).float().mean().item())
        assert result.eval_loss == pytest.approx(loss, rel=1e-6)
    # Per evaluation, whatever its batches: the device's sums read once (and whatever the
    # scoring reads of the control group's CPU totals, no wait on a GPU).
    assert reads[0] == reads[1], reads


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


class OrderedEvent:
    """torch.cuda.Event that logs, in order, its recording and every wait for it."""

    log: list[tuple] = []
    made = 0

    def __init__(self, enable_timing: bool = False) -> None:
        OrderedEvent.made += 1
        self.name = f"e{OrderedEvent.made}"

    def record(self, stream=None) -> None:
        self.log.append(("record", self.name))

    def synchronize(self) -> None:
        self.log.append(("wait", self.name))


def test_autocache_on_a_gpu_stages_rows_in_two_pinned_buffers_and_writes_after_the_copy(
    monkeypatch,
):
    """AutoCache's CUDA path, run on fake CUDA tensors against a real store (bfloat16, the
    first 6 of 12 samples cached): the cached rows are read into one of two pinned host
    buffers taken in turn, copied to the device without waiting and converted there; a
    buffer is refilled only after the event marking its copy; the rows computed for the
    misses are copied to pinned host memory without waiting and written to the store at
    the next call, after the event marking that copy."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from pipetransformer.autocache import CacheClient, CacheDaemon
    from pipetransformer.pipe.prefix import CachedPrefix

    monkeypatch.setattr(torch.cuda, "Event", OrderedEvent)
    OrderedEvent.log, OrderedEvent.made = [], 0
    log = OrderedEvent.log
    FakeCudaStreams().install(monkeypatch, events=False, copies=False)  # tests/test_gpu_path.py
    pinned, empty = [], torch.empty

    def recording_empty(*args, pin_memory=False, **kwargs):
        tensor = empty(*args, **kwargs)
        if pin_memory:
            pinned.append(tensor)
        return tensor

    monkeypatch.setattr(torch, "empty", recording_empty)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)  # no fake kernel

    class Recording:
        """The client, its reads and writes logged (written values are fake: not stored)."""

        def __init__(self, client) -> None:
            self.client, self.outs, self.writes = client, [], []

        def layout(self, split):
            return self.client.layout(split)

        def read(self, split, ids, out=None, as_stored=False, length=None):
            log.append(("read", len(self.outs)))
            self.outs.append(out)
            return self.client.read(split, ids, out=out, as_stored=as_stored, length=length)

        def write(self, split, ids, layer, tensors):
            log.append(("write", len(self.writes)))
            self.writes.append((split, ids.tolist(), layer, tensors))

    cuda = torch.device("cuda", 0)
    model = tiny_vit(device="meta")
    specs = list(model.spec.activation_specs)
    splits = {"train": (12, specs)}
    with (
        CacheDaemon.start(splits, memory_budget_bytes=1 << 26, storage_dtype="bfloat16") as daemon,
        CacheClient.attach(daemon.address) as client,
    ):
        client.write("train", list(range(6)), 1, [spec.example(6, "cpu") for spec in specs])
        recording = Recording(client)
        counts = {"hits": 0, "upgrades": 0, "misses": 0}
        with FakeTensorMode(allow_non_fake_inputs=True):
            units = {i: unit.to_empty(device=cuda) for i, unit in enumerate(model.units)}
            prefix = CachedPrefix(units, 1, recording, cuda, counts)
            images = torch.empty(12, 1, 8, 8, device=cuda)
            calls = []
            for _ in range(3):
                log.append("call")
                calls.append(prefix("train", list(range(12)), (images,)))
            log.append("flush")
            prefix.flush()
        assert counts == {"hits": 18, "upgrades": 0, "misses": 18}
    for out in calls:  # the rows on the device, in float32, as the stage takes them
        assert [(t.device, t.dtype, t.shape[0]) for t in out] == [(cuda, torch.float32, 12)]
    # Call 1 reads into buffer 1, marks its copy (e1) and the misses' copy to the host (e2).
    # Call 2 waits for e2 and writes those rows, reads into buffer 0 (e3), copies (e4).
    # Call 3 writes call 2's rows after e4, and refills buffer 1 only after e1.
    assert log == [
        "call", ("read", 0), ("record", "e1"), ("record", "e2"),
        "call", ("wait", "e2"), ("write", 0), ("read", 1), ("record", "e3"), ("record", "e4"),
        "call", ("wait", "e4"), ("write", 1), ("wait", "e1"), ("read", 2), ("record", "e5"),
        ("record", "e6"),
        "flush", ("wait", "e6"), ("write", 2),
    ]  # fmt: skip
    buffers = [[id(t._base) for t in out] for out in recording.outs]
    assert buffers[0] == buffers[2] and buffers[0] != buffers[1]  # two buffers, in turn
    assert all(any(b == id(p) for p in pinned) for bs in buffers for b in bs)
    for split, ids, layer, tensors in recording.writes:
        assert (split, ids, layer) == ("train", list(range(6, 12)), 1)
        assert all(t.device.type == "cpu" and any(t is p for p in pinned) for t in tensors)
        assert [t.dtype for t in tensors] == [torch.bfloat16]  # cast on the device


def test_autocaches_read_measurement_copies_from_pinned_memory_on_a_gpu(monkeypatch):
    """The read time that decides whether caching pays is measured through the step's own
    path (CachedPrefix's staging): in the stored dtype into the two pinned buffers, allocated
    once and taken in turn, copied without waiting, converted on the device, and the device
    waited for once per repeat (fake CUDA tensors, a real store). It read into pageable
    memory and pinned a copy at every repeat: a cost no step pays, so caching switched on
    later than it should."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from pipetransformer.autocache import CacheClient, CacheDaemon
    from pipetransformer.autodp.control import Control
    from pipetransformer.trainer import caching
    from pipetransformer.trainer.distributed import WorldInfo

    pinned_copies, waits, pinned, empty = [], [], [], torch.empty

    def recording_empty(*args, pin_memory=False, **kwargs):
        tensor = empty(*args, **kwargs)
        if pin_memory:
            pinned.append(tensor)
        return tensor

    monkeypatch.setattr(torch, "empty", recording_empty)
    monkeypatch.setattr(torch.cuda, "Event", OrderedEvent)
    OrderedEvent.log, OrderedEvent.made = [], 0
    FakeCudaStreams().install(monkeypatch, events=False, copies=False)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: pinned_copies.append(self) or self)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waits.append(device))
    cuda = torch.device("cuda", 0)
    specs = list(tiny_vit(device="meta").spec.activation_specs)
    with (
        CacheDaemon.start({"train": (8, specs)}, memory_budget_bytes=1 << 26) as daemon,
        CacheClient.attach(daemon.address) as client,
    ):
        cache = caching.RunCache.__new__(caching.RunCache)
        cache.client, cache.control = client, Control(None)
        cache.world = WorldInfo(0, 1, 0, 1, cuda)
        with FakeTensorMode(allow_non_fake_inputs=True):
            seconds = cache._measure_read(8)
    assert seconds > 0 and waits == [cuda] * caching.READ_REPEATS
    assert pinned_copies == []  # nothing pinned on the way: read into pinned buffers
    assert len(pinned) == 2 * len(specs)  # the staging's two buffers, allocated once
    records = [entry for entry in OrderedEvent.log if entry[0] == "record"]
    assert len(records) == caching.READ_REPEATS  # each copy marked for the buffer's reuse


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


def _audit_config(kind: str, sst2_root: Path) -> dict:
    """2 ranks: a 2-stage pipeline, then (frozen_after layers frozen) one stage x 2
    replicas served by AutoCache; AdamW; M measured ('auto'); BERT in bf16. `kind`: the
    model, or the model and a schedule ('bert-interleaved_1f1b': its 2 chunks a rank)."""
    kind, _, schedule = kind.partition("-")
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
    if schedule:
        config["pipeline"]["schedule"] = schedule
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
            "root": str(sst2_root),
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


# The chunked schedules: BERT's text of several lengths (a stage and schedule of 2 chunks
# per bucket) under interleaved 1F1B; ViT under zero bubble, slow for the default suite's 5
# minutes (about 3 s).
AUDITED = [
    "bert",
    "vit",
    "bert-interleaved_1f1b",
    pytest.param("vit-zero_bubble", marks=pytest.mark.slow),
]


@pytest.fixture(scope="module", params=AUDITED)
def audited(request, tmp_path_factory, sst2_dir):
    from gpu_workers import audited_run
    from helpers import run_workers

    config = _audit_config(request.param, sst2_dir)
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
        assert ("virtual_stages=2" in layouts[0]) == ("-" in kind), layouts
        assert result["phases"][1]["cache_active"]
        for phase in result["phases"]:
            assert phase["host_reads"] == [], (kind, rank, phase["layout"], phase["host_reads"])
            assert phase["blocking"] == [], (kind, rank, phase["layout"], phase["blocking"])


@pytest.mark.distributed
def test_collectives_are_what_nccl_takes_and_every_rank_makes_the_same_groups(audited):
    """And every rank issues the collectives of the groups it shares with another in the
    same order, with the same tensors (DDP's own buckets run inside its reducer, unseen;
    clipping's, the freeze signal's and the control group's are seen)."""
    kind, results = audited
    order = {rank: result["collectives"] for rank, result in enumerate(results)}
    assert collective_order_problem(order) is None, (kind, collective_order_problem(order))
    assert all(len(seen) > 10 for seen in order.values())
    for result in results:
        assert result["violations"] == [], (kind, result["violations"])
        assert result["counts"].get("training:all_reduce", 0) > 0  # DDP ran in phase 2
        pipeline_p2p = ("training:send", "training:recv", "training:batch_isend_irecv")
        assert sum(result["counts"].get(op, 0) for op in pipeline_p2p) > 0  # and the pipeline
    assert results[0]["groups"] == results[1]["groups"] and results[0]["groups"]


@pytest.fixture(scope="module")
def audited_sharded(tmp_path_factory, sst2_dir):
    """The BERT audit run (bf16) sharded from the start (FSDP2 over both ranks), then 3
    layers frozen: sharded again, the trained layers' shards carried, AutoCache serving."""
    from gpu_workers import audited_run
    from helpers import run_workers

    config = _audit_config("bert", sst2_dir)
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


@pytest.mark.parametrize(
    ("device", "precision"), [("cuda", "bf16"), ("cuda", "fp32"), ("cpu", "bf16")]
)
def test_a_sharded_layout_on_cuda_gathers_what_autocast_computes_in(device, precision, monkeypatch):
    """Gathering float32 inside a bf16 autocast region moved twice the bytes and left
    autocast a bfloat16 copy of every resharded layer, held from forward to backward. On
    CUDA FSDP2 gathers bfloat16 and reduces float32; on the CPU it gathers float32 (CPU
    autocast's layer norm refuses bfloat16 weights). Every fully_shard call of a layout
    built for the device is recorded (FSDP2 and the mesh stubbed: no device is touched)."""
    from pipetransformer.autopipe.planner import PipelinePlan
    from pipetransformer.fsdp import runtime

    policies = []
    monkeypatch.setattr(runtime, "fully_shard", lambda m, **kw: policies.append(kw["mp_policy"]))
    monkeypatch.setattr(runtime.DeviceMesh, "from_group", staticmethod(lambda *a, **kw: None))
    units = dict(enumerate(tiny_bert(device="meta").units))
    plan = PipelinePlan(1, 1, 1, ((1, len(units)),), (1.0,))
    autocast = torch.bfloat16 if precision == "bf16" else None
    group = type("Group", (), {"group_name": "0"})()
    runtime.build_sharded_runtime(
        plan=plan,
        replica_batch_size=4,
        units=units,
        loss_fn=None,
        data_group=group,
        device=torch.device(device),
        autocast_dtype=autocast,
    )
    assert len(policies) > 1
    gathered = torch.bfloat16 if (device, precision) == ("cuda", "bf16") else None
    for policy in policies:
        assert policy.param_dtype == gathered and policy.reduce_dtype in (None, torch.float32)
        assert gathered is None or not policy.cast_forward_inputs  # the float32 stream


@pytest.mark.distributed
def test_a_sharded_layout_keeps_the_float32_residual_stream_under_bf16():
    """A real one-rank FSDP2 layout (gloo) with the policy a CUDA device gets under bf16:
    bfloat16 gathers, and every layer group receives the float32 hidden state that the
    pipeline and DDP layouts keep (autocast computes the matmuls in bfloat16; the residual
    adds and layer norms stay float32). FSDP2's default `cast_forward_inputs=True` cast each
    group's input to bfloat16: the whole residual stream rounded to bfloat16, so a
    DDP <-> sharded transition changed the numbers. The CPU's own policy gathers float32."""
    from gpu_workers import sharded_stream_dtypes
    from helpers import run_workers

    for cuda_policy, gathered in ((True, "torch.bfloat16"), (False, "torch.float32")):
        (result,) = run_workers(sharded_stream_dtypes, 1, cuda_policy)
        assert len(result["received"]) == 9, result  # 4 layers x 2 sublayers and the head
        assert set(result["received"]) == {"torch.float32"}, (cuda_policy, result["received"])
        assert result["weights"] == [gathered], (cuda_policy, result)
        assert result["loss"] == pytest.approx(0.69, abs=0.05)


@pytest.mark.distributed
def test_ranks_plan_with_the_least_memory_and_refuse_to_build_groups_apart(tmp_path):
    """Each rank read its own GPU's free memory for the budget that sets the first pipeline
    length and which transitions fit: one busier GPU made ranks plan different layouts, and
    `new_group`/`split_group` then received different partitions: a hang until the
    collective timeout, without a message. The budget is now the least over the control
    group, and every rank compares the layout it enters before building any group: one line
    naming the ranks and what differs."""
    from gpu_workers import ranks_planning_apart
    from helpers import run_workers

    config = {
        "trainer": {"epochs": 1, "global_batch_size": 16, "nproc_per_node": 2, "device": "cpu"},
        "model": {
            "name": "vit_tiny_patch16_224",
            "kwargs": {"patch_size": 4, "embed_dim": 32, "depth": 2, "num_heads": 2},
        },
        "data": {"name": "digits", "image_size": 8, "train_subset": 64},
        "pipeline": {"balance": "params"},
        "cache": {"enabled": False},
    }
    results = run_workers(ranks_planning_apart, 2, config, str(tmp_path))
    assert [r["budget"] for r in results] == [2.0**30] * 2, results
    assert results[0]["initial_pipe_len"] == results[1]["initial_pipe_len"]
    for result in results:
        assert result["groups_built"] == 0, result
        error = result["error"]
        assert error.startswith("ranks disagree on the layout they enter") and "\n" not in error
        assert "micro_batches 1 on rank(s) 0 but 2 on rank(s) 1" in error, error


@pytest.mark.distributed
def test_signal_to_noise_reads_the_whole_models_momentum_in_every_one_stage_layout(
    audited, audited_sharded
):
    """signal_to_noise's ||m||^2 per unit, as the trainer computes it at a decision point:
    in a sharded layout the moments are DTensor shards (multiplying them by a plain tensor
    raised) whose squares sum over the ranks (dividing by the replicas, as for DDP's
    copies, halved them); in DDP every replica holds it all (counted once)."""
    kind, results = audited
    phases = [p for r in results for p in r["phases"]]
    phases += [p for r in audited_sharded for p in r["phases"]]
    checked = [p for p in phases if p["momentum"] is not None]
    assert len(checked) >= 6, [p["layout"] for p in phases]  # DDP x 2 ranks, sharded x 4
    for phase in checked:
        got, expected = phase["momentum"]
        assert any(expected), phase["layout"]
        assert got == pytest.approx(expected, rel=1e-6, abs=1e-12), phase["layout"]


def test_signal_to_noise_reads_no_device_step_count_on_the_host(monkeypatch):
    """Fused AdamW keeps its step count on the device: a `float()` of it for each parameter
    at every decision was a synchronisation each (a fake tensor refuses to be read)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from pipetransformer.config import OptimizerConfig
    from pipetransformer.trainer import optim

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)  # no fake kernel
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device=cuda)
        named = {"units.0.weight": model[0].weight, "units.1.weight": model[1].weight}
        config = OptimizerConfig(name="adamw", implementation="fused")
        optimizer = optim.build_optimizer(config, named)
        for p in named.values():
            p.grad = torch.zeros_like(p)
        optimizer.step()
        assert all(s["step"].device == cuda for s in optimizer.state.values())
        squares = optim.momentum_sq_by_unit(optimizer, named, 2, cuda)
        assert squares.device == cuda and squares.shape == (2,)


@pytest.mark.distributed
def test_a_sharded_layouts_modules_are_freed_when_it_goes(audited_sharded):
    """FSDP2's modules, states and parameter groups refer to one another (hooks, a context
    shared by the root's states): with the collector off, every module of the old sharded
    layout (and the shards and gradients they hold on the device) stayed alive after the
    transition, until a collection that a run with the collector on makes when it likes."""
    for result in audited_sharded:
        alive, built = result["old_sharded_modules"]
        assert built > 0 and alive == 0, (alive, built)


@pytest.mark.distributed
def test_the_old_layouts_parameters_are_gone_while_the_new_one_is_built(audited, audited_sharded):
    """With the collector off, at every runtime the transition builds (the micro-batch trials
    and the new stage), none of the old stage's trained parameters that the new units do not
    hold, its gradient owner index and AutoFreeze's sums (an fp32 copy of every trained
    parameter) is alive: `Stage.grad_owners` and `grad_sums` kept them, and with them the
    released units' storage (a sharded layout's shards), on the device while the new layout
    was built."""
    kind, results = audited
    for result in [*results, *audited_sharded]:
        taken, alive = result["old_tensors"]
        assert taken > 0 and alive and set(alive) == {0}, (kind, taken, alive)


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
        pytest.skip("an fp32 audit run: autocast's copies are checked on the bf16 one (bert)")
    pipeline = [r["phases"][0] for r in results]
    assert all(p["num_micro_batches"] >= 2 for p in pipeline)
    # Stage 0 holds only the embedding (nothing autocast copies); stage 1 the layers.
    assert max(p["most_casts_of_a_weight"] for p in pipeline) == 1, pipeline
