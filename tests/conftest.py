import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The suite runs its workers as CPU processes whatever the machine has: a distributed test
# asks for 2-4 ranks with trainer.device auto, which on a machine with fewer GPUs than
# ranks would be refused (NCCL takes one GPU per process). Hidden before torch first looks
# for a GPU; the workers and the CLI subprocesses inherit it. The `gpu` tests run with
# PIPETRANSFORMER_TEST_GPU=1 (docs/gpus.md).
GPU_TESTS = os.environ.get("PIPETRANSFORMER_TEST_GPU") == "1"
if not GPU_TESTS:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import pytest  # noqa: E402
import torch  # noqa: E402

# Tests run many small processes on few cores: one thread each.
torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parent.parent
# The real data beside the checkout (a fresh clone has none); PIPETRANSFORMER_SHARED_DATA
# points elsewhere, or at nothing to run the suite as a fresh clone does.
SHARED_DATA = Path(os.environ.get("PIPETRANSFORMER_SHARED_DATA", ROOT.parent / "shared" / "data"))
sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture
def shared_data() -> Path:
    """The real data, for what only it shows (its size, an accuracy a pretrained model
    reaches on it); everything else uses the files below, which the tests write."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"{SHARED_DATA} is not present")
    return SHARED_DATA


@pytest.fixture(scope="session")
def sst2_dir(tmp_path_factory) -> Path:
    """SST-2's train.tsv (600 sentences) and dev.tsv (120), written once (datagen.py)."""
    from datagen import write_sst2

    return write_sst2(tmp_path_factory.mktemp("sst2"))


@dataclass(frozen=True)
class SquadFiles:
    train: Path  # 162 questions over 27 paragraphs, one answer each
    eval: Path  # 96 other questions, two or three reference answers each


@pytest.fixture(scope="session")
def squad_files(tmp_path_factory) -> SquadFiles:
    """SQuAD v1.1 training and evaluation files, written once (datagen.py)."""
    from datagen import write_squad

    root = tmp_path_factory.mktemp("squad")
    return SquadFiles(
        write_squad(root / "train-v1.1.json"),
        write_squad(
            root / "eval-v1.1.json",
            articles=2,
            paragraphs=8,
            seed=1,
            id_prefix="e",
            references=True,
        ),
    )


@dataclass(frozen=True)
class SharedRun:
    """A run made once for the tests that only read it (copy `run_dir` before changing it)."""

    config_dict: dict
    run_dir: Path
    results: list[Any]  # each rank's return value


@pytest.fixture(scope="session")
def elastic_full_run(tmp_path_factory) -> SharedRun:
    """The full system on 4 gloo ranks, 1x4 -> 2x2 -> 4x1 (reference.elastic_config), with a
    checkpoint every 5 steps and at each epoch's end, all kept, the sample ids each rank
    read (trainer.record_sample_ids) and layer-wise annealing (each layer's rate annealed to
    zero by its freeze): read by the elastic test against single-process training and by
    the resume tests as the uninterrupted run. (The same layouts without annealing:
    test_elastic.py's `full_clipped`.)"""
    from helpers import run_workers
    from reference import elastic_config
    from workers import elastic_run

    config_dict = elastic_config(
        checkpoint__interval_steps=5,
        checkpoint__keep_last=20,
        trainer__record_sample_ids=True,
        optimizer__layerwise_anneal=True,
    )
    run_dir = tmp_path_factory.mktemp("elastic-full")
    return SharedRun(config_dict, run_dir, run_workers(elastic_run, 4, config_dict, str(run_dir)))


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto` (pyproject's addopts): one pytest worker per core, at most 4 and one per
    4 GiB of memory (a worker's distributed test runs up to 4 ranks of a few hundred MiB
    each), or PYTEST_XDIST_AUTO_NUM_WORKERS. None with the GPU tests: they share one GPU.
    Two workers on 2 cores keep both busy: alone, the suite leaves a third of the cores'
    time idle (single-process tests, start-up, ranks waiting on each other)."""
    if "PYTEST_XDIST_AUTO_NUM_WORKERS" in os.environ:
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    if GPU_TESTS:
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return max(1, min(cores or 1, 4, int(memory_gib // 4)))


def pytest_collection_modifyitems(config, items):
    if GPU_TESTS and torch.cuda.is_available():
        return
    reason = "needs CUDA and PIPETRANSFORMER_TEST_GPU=1" if not GPU_TESTS else "needs CUDA"
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
