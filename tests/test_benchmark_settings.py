"""Every benchmark pins what its labels claim (issue 62): each benchmark's settings are run
through the config resolver (`load_config`: the file, its when_pretrained settings, the
overrides) and the keys its labels name are checked, so that a default changed later (the
padding, the SQuAD config's start, the local configs' pretrained settings) cannot change
what a benchmark measures under an unchanged label. No run starts."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import pytest

from pipetransformer.config import load_config
from pipetransformer.freeze import bound_trajectory

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import freeze_frontier  # noqa: E402
import harness  # noqa: E402
import padding  # noqa: E402
import trainer_callback  # noqa: E402


def shell_benchmark_overrides(script: str, minilm: Path) -> tuple[str, list[str]]:
    """(the config, the `key=value` overrides) a benchmark shell script passes to the CLI,
    with $MINILM and $DATA as the script sets them."""
    text = (ROOT / "benchmarks" / script).read_text()
    command = text.split("exec pipetransformer compare ", 1)[1].split("--out", 1)[0]
    words = shlex.split(command.replace("\\\n", " "))
    words = [w.replace('"$MINILM"', str(minilm)).replace("$MINILM", str(minilm)) for w in words]
    words = [w.replace("$DATA", str(ROOT.parent / "shared" / "data")) for w in words]
    return words[0], [w for w in words[1:] if "=" in w and not w.startswith("-")]


@pytest.fixture
def minilm(tmp_path, monkeypatch) -> Path:
    """A model directory where the benchmarks name the offline MiniLM (its contents are the
    workers' business, not the config's)."""
    path = tmp_path / "minilm"
    path.mkdir()
    monkeypatch.setattr(padding, "minilm_dir", lambda script: str(path))
    monkeypatch.setattr(harness, "minilm_dir", lambda script: str(path))
    return path


@pytest.mark.parametrize("script", ["bert_sst2_minilm.sh", "bert_squad_minilm.sh"])
def test_the_minilm_scripts_pin_what_their_headers_say(script, minilm):
    """Pinned: no freeze warm-up, three decisions an epoch, the shortest pipeline that fits,
    AutoCache, Eq. 1 with its bound compressed by parameter counts (the rule its records
    ran, where the SST-2 config's pretrained default since freezes by memory); the config's
    own: the freeze strategy, the embedding, the padding."""
    config_path, overrides = shell_benchmark_overrides(script, minilm)
    config = load_config(ROOT / config_path, overrides)
    shipped = load_config(ROOT / config_path)
    assert config.model.model_name_or_path == str(minilm) and config.model.kwargs == {}
    assert config.freeze.warmup_epochs == 0 and config.freeze.interval_steps == "auto"
    assert not config.freeze.memory_aware and config.freeze.eq1_bound
    assert config.autopipe.compression == "params"
    assert config.pipeline.initial_pipe_len == "auto" and config.cache.enabled
    assert (config.optimizer.lr, config.optimizer.warmup_steps) == (1e-4, 10)
    assert (config.trainer.global_batch_size, config.trainer.epochs) == (32, 3)
    assert config.freeze.strategy == shipped.freeze.strategy  # "the config's"
    assert config.data.padding == shipped.data.padding and config.embedding_frozen
    assert config.data.eval_subset is None
    header = (ROOT / "benchmarks" / script).read_text().split("set -euo", 1)[0]
    assert "convergence" not in header and "the defaults" not in header


def padding_args(smoke: bool = False) -> argparse.Namespace:
    return argparse.Namespace(train=2000, epochs=2, eval=None, smoke=smoke)


@pytest.mark.parametrize("workload", list(padding.WORKLOADS))
def test_the_padding_benchmark_pins_each_variants_padding(workload, minilm):
    """`ddp` and `full` are labelled per-batch padding: with `auto` the default they would
    measure packing under that label. The full system runs the rule its records ran, and
    on SQuAD the 2-stage start its record ran."""
    config_path, overrides, names = padding.WORKLOADS[workload]
    for name in names:
        command, _ = padding.VARIANTS[name]
        if command is not padding.TRAIN:  # a Trainer peer: its own collator, no data.padding
            continue
        config = load_config(
            ROOT / config_path,
            [*overrides(padding_args()), *padding.variant_overrides(workload, name)],
        )
        expected = "packed" if "packed" in name else "max_length" if "max_length" in name else ""
        assert config.data.padding == (expected or "batch"), name
        assert config.data.group_by_length == ("grouped" in name), name
        if name.startswith("ddp"):
            assert config.freeze.strategy == "none" and config.pipeline.initial_pipe_len == 1
            assert config.pipeline.num_micro_batches == 1, name
        else:
            assert config.freeze.strategy == "gradient_norm", name
            assert config.freeze.eq1_bound and not config.freeze.memory_aware, name
            assert config.autopipe.compression == "params", name
            assert config.freeze.interval_steps is None, name
            start = 2 if workload == "squad_384" else "auto"
            assert config.pipeline.initial_pipe_len == start, name
        assert config.optimizer.lr == 1e-4 and config.trainer.global_batch_size == 32


# A label's words -> what the resolved config must hold (benchmarks/freeze_frontier.py's
# VARIANTS: a rule and the setting its tables show).
FRONTIER_LABELS = {
    "no freezing": lambda c: c.freeze.strategy == "none",
    "K = 2": lambda c: c.pipeline.initial_pipe_len == 2,
    "Eq. 1 (gradient_norm)": lambda c: c.freeze.strategy == "gradient_norm" and c.freeze.eq1_bound,
    "eq1_bound false": lambda c: c.freeze.strategy == "gradient_norm" and not c.freeze.eq1_bound,
    "AutoFreeze": lambda c: c.freeze.strategy == "autofreeze",
    "convergence": lambda c: c.freeze.strategy == "convergence",
    "at epoch ends": lambda c: c.freeze.interval_steps is None,
    "3 an epoch": lambda c: c.freeze.interval_steps == "auto",
    "a tenth of the run": lambda c: c.freeze.num_intervals == 10,
    "a twentieth of the run": lambda c: c.freeze.num_intervals == 20,
    "embedding frozen": lambda c: c.embedding_frozen,
    "embedding trained": lambda c: not c.embedding_frozen,
    "alpha 1/3": lambda c: c.freeze.alpha == pytest.approx(1 / 3),
    "alpha 1/2": lambda c: c.freeze.alpha == 0.5,
    "at most 3 frozen": lambda c: c.freeze.max_frozen_layers == 3,
    "clipped gradients": lambda c: not c.freeze.signal_before_clipping,
    "raw gradients": lambda c: c.freeze.signal_before_clipping,
    "threshold 0.05": lambda c: c.freeze.convergence_threshold == 0.05,
}


def test_the_frontier_variants_are_what_their_labels_say(minilm):
    args = argparse.Namespace(tiny=False, train=4000, epochs=3)
    common = freeze_frontier.common_overrides(args)
    checked = 0
    for name, (rule, setting, command, extra) in freeze_frontier.VARIANTS.items():
        if command is not freeze_frontier.TRAIN:
            continue
        config = load_config(ROOT / "configs" / "bert_sst2_local.yaml", [*common, *extra])
        label = f"{rule}, {setting}"
        for words, holds in FRONTIER_LABELS.items():
            if words in label:
                assert holds(config), f"{name}: '{words}'"
                checked += 1
    assert checked >= 30


def test_the_trainer_callback_sides_are_what_their_titles_say(minilm):
    """Each side of benchmarks/trainer_callback.py at the full budget: plain Trainer trains
    everything; the callback's sides keep the config's rule and embedding and differ only in
    how far Eq. 1's bound lets them go on MiniLM's 6 layers at its decisions (2 then 4; held
    at 2; 1 then 2 at alpha 1/6; one decision after 2 epochs: 2, or 4 at alpha 2/3), as
    section 24 of docs/benchmarks.md reads them."""
    args = argparse.Namespace(
        tiny=False,
        train=2000,
        epochs=3,
        override=[],
        data_root=ROOT,
        sides=list(trainer_callback.SIDES),
        budgets=[1, 2, 3],
        freeze_budgets=[3],
    )
    common = trainer_callback.workload(args)
    runs = trainer_callback.planned_runs(args, common)
    shipped = load_config(trainer_callback.CONFIG)
    expected = {
        trainer_callback.FREEZE: [2, 4],
        trainer_callback.THIRD: [2, 2],
        trainer_callback.SIXTH: [1, 2],
        trainer_callback.LATE: [2],
        trainer_callback.LATE_FOUR: [4],
    }
    seen = set()
    for name, (side, overrides) in runs.items():
        config = load_config(trainer_callback.CONFIG, [*common, *overrides])
        assert config.data.max_seq_length == 128 and config.trainer.evals_per_epoch == 4
        seen.add(side)
        if side == trainer_callback.PLAIN:
            assert config.freeze.strategy == "none"
            continue
        if side == trainer_callback.EMBEDDING:
            continue  # the callback's own schedule (compare.peers.EMBEDDING_ONLY)
        assert name.endswith("_3ep"), f"{name}: the callback's sides run the full budget"
        assert config.freeze.strategy == shipped.freeze.strategy
        # Decisions at the ends of epochs max(1, warm-up) .. 2 of 3 (none at the run's end).
        decisions = 3 - max(1, config.freeze.warmup_epochs)
        cap = config.freeze.max_frozen_layers
        trajectory = bound_trajectory(6, config.freeze.alpha, decisions, cap)
        assert trajectory == expected[side], f"{side}: {trajectory}"
    assert seen == set(trainer_callback.SIDES)
    args.sides = [trainer_callback.PLAIN, trainer_callback.SIXTH]
    assert {side for side, _ in trainer_callback.planned_runs(args, common).values()} == set(
        args.sides
    )
    # Time-to-target and peaks are read against the config's rule where it ran, else
    # against the first callback side run (section 24c's late rule), never plain Trainer.
    reference = trainer_callback.reference_side
    assert reference(list(trainer_callback.SIDES)) == trainer_callback.FREEZE
    late = [trainer_callback.PLAIN, trainer_callback.EMBEDDING, trainer_callback.LATE]
    assert reference(late) == trainer_callback.LATE
