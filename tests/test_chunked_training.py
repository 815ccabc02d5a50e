"""interleaved_1f1b and zero_bubble through the trainer, against single-process training.

One launch of 4 gloo workers runs, one after the other (tests/workers.py `elastic_runs`):
- each chunked schedule through the elastic test's layouts, 4 stages x 2 chunks -> 2 x 2
  replicas of 2 stages x 2 chunks -> plain DDP on 4 ranks (3 then 5 of 6 layers frozen, SGD
  with momentum), with `virtual_stages: auto` for interleaved 1F1B (two chunks a rank) and
  2 for zero bubble, whose gradients are clipped at every step;
- interleaved 1F1B with each rank's state copied before and after each transition (the
  handoff, bit for bit), then resumed from its checkpoint in the 2 x 2 chunked layout
  (step 10), through the transition to DDP;
and, in a launch of its own (slow), zero bubble with AutoPipe off (freeze only): frozen units
stay inside the chunks. Each equals the plain single-process loop over the same batches
(tests/reference.py) at every step (losses 1e-5) and in its final weights (rtol 1e-4 /
atol 1e-5: float32 sums in another order, as tests/test_elastic.py); the resumed run equals
the uninterrupted one. About 12 s on 2 idle cores.
"""

import json
from pathlib import Path

import pytest
import torch
from helpers import assert_handoff_carried, run_workers
from reference import elastic_config, reference_run, step_losses
from workers import elastic_runs

from pipetransformer.config import config_from_dict

pytestmark = pytest.mark.distributed

CHUNKED = dict(
    checkpoint__interval_steps=5,
    checkpoint__keep_last=20,
    pipeline__num_micro_batches=4,  # M >= K = 4 at the start
)
RUNS = {
    "interleaved_1f1b": elastic_config(pipeline__schedule="interleaved_1f1b", **CHUNKED),
    # Clipped at every step: the global norm over a rank's chunks and the pipeline's ranks,
    # of the gradients the rank's own all-reduce averaged.
    "zero_bubble": elastic_config(
        pipeline__schedule="zero_bubble",
        pipeline__virtual_stages=2,
        optimizer__max_grad_norm=0.05,
        **CHUNKED,
    ),
}
# Frozen units stay inside the chunks (AutoPipe off): its own launch, marked slow.
FREEZE_ONLY = elastic_config(pipeline__schedule="zero_bubble", autopipe__enabled=False, **CHUNKED)
RESUME_AT_STEP = 10  # epoch 2, step 3 of 7: the 2 x 2 layout of 2 chunks a stage


@pytest.fixture(scope="module")
def chunked_runs(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("chunked")
    results = run_workers(
        elastic_runs,
        4,
        list(RUNS.items()),
        str(root),
        RESUME_AT_STEP,
        {"interleaved_1f1b"},
        {"interleaved_1f1b"},
    )
    return root, {name: [r[name] for r in results] for name in results[0]}


def events(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["kind"] == kind]


@pytest.mark.parametrize("name", list(RUNS))
def test_a_chunked_run_trains_as_one_process_does(chunked_runs, name):
    root, results = chunked_runs
    check_against_one_process(RUNS[name], root / name, results[name][0]["state"][0])


@pytest.mark.slow
def test_zero_bubble_with_frozen_units_inside_its_chunks_trains_as_one_process_does(tmp_path):
    """AutoPipe off: the layout stays 4 x 2 chunks, frozen units inside them, so a chunk
    after the first receives an input without gradient (torch's I step would give it no
    weight gradients: pipe/runtime.py runs its backward whole). Slow only for the default
    suite's 5 minutes: about 5 s."""
    results = run_workers(elastic_runs, 4, [("freeze_only", FREEZE_ONLY)], str(tmp_path))
    check_against_one_process(
        FREEZE_ONLY, tmp_path / "freeze_only", results[0]["freeze_only"]["state"][0]
    )


def check_against_one_process(config_dict: dict, run_dir: Path, state: dict) -> None:
    """The run's layouts have 2 chunks a stage while the pipeline lasts (AutoPipe packing
    4 x 1 -> 2 x 2 -> 1 x 4, or nothing with AutoPipe off), and its every step's loss and
    its final weights are single-process training's."""
    freeze_only = not config_dict.get("autopipe", {}).get("enabled", True)
    (start,) = events(run_dir, "start")
    assert (start["pipe_len"], start["virtual_stages"]) == (4, 2)
    layouts = [
        (e["new_pipe_len"], e["new_dp_degree"], e["new_virtual_stages"], len(e["new_stage_ranges"]))
        for e in events(run_dir, "transition")
    ]
    assert layouts == ([(4, 1, 2, 8)] * 2 if freeze_only else [(2, 2, 2, 4), (1, 4, 1, 1)])

    ref_losses, ref_state, _ = reference_run(config_from_dict(config_dict))
    got = step_losses(run_dir)
    assert len(got) == len(ref_losses)
    for step, (a, b) in enumerate(zip(got, ref_losses)):
        assert a == pytest.approx(b, abs=1e-5), f"step {step}"
    assert set(state) == set(ref_state)
    for key, value in ref_state.items():
        torch.testing.assert_close(
            state[key], value, rtol=1e-4, atol=1e-5, msg=lambda m, key=key: f"{key}: {m}"
        )


def test_the_handoff_between_chunked_layouts_and_into_ddp_is_bit_exact(chunked_runs):
    """Weights and momentum buffers arrive unchanged wherever they move: 4 stages x 2 chunks
    -> 2 x 2 replicas of 2 x 2 chunks (units that are not contiguous on a rank, before and
    after) -> DDP on 4 ranks; units newly frozen arrive without optimizer state."""
    _, results = chunked_runs
    ranks = [r["handoffs"] for r in results["interleaved_1f1b"]]
    assert all(len(h) == 2 for h in ranks)
    moved = 0
    for phase, chunks in enumerate([(2, 2), (2, 1)]):
        before = [h[phase][0] for h in ranks]
        after = [h[phase][1] for h in ranks]
        assert (before[0][0].plan.virtual_stages, after[0][0].plan.virtual_stages) == chunks
        moved += assert_handoff_carried(before, after)
    assert moved > 0  # state really moved between ranks


def test_a_resume_from_the_chunked_layout_reproduces_the_run(chunked_runs):
    """The checkpoint holds units, not chunks: resumed in the 2 x 2 layout of 2 chunks a
    stage, the run re-cuts its chunks, moves on to DDP and ends where the uninterrupted run
    ended (losses and weights to float32 rounding of the same operations)."""
    root, results = chunked_runs
    full, resumed = root / "interleaved_1f1b", root / "interleaved_1f1b-resumed"
    (event,) = events(resumed, "resume")
    assert (event["global_step"], event["pipe_len"], event["dp_degree"]) == (10, 2, 2)
    after = [e for e in events(resumed, "transition") if e["global_step"] > 10]
    assert [(e["new_pipe_len"], e["new_virtual_stages"]) for e in after] == [(1, 1)]
    assert step_losses(resumed) == pytest.approx(step_losses(full), abs=1e-6)
    state = results["interleaved_1f1b-resumed"][0]["state"][0]
    reference = results["interleaved_1f1b"][0]["state"][0]
    assert set(state) == set(reference)
    for key, value in reference.items():
        torch.testing.assert_close(
            state[key], value, rtol=0, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}"
        )


# ----------------------------------------------------------------------------- the configs

ROOT = Path(__file__).resolve().parent.parent
# The configs as shipped, cut to tiny sizes and started as a pipeline; freezing by a fixed
# schedule at epoch ends, the frozen prefix at the elastic tests' lambda_frozen (Eq. 2 then
# packs as the plans below say), and SGD so that micro-batches and all-reduces agree with
# one process to float32 rounding (docs/pytorch.md: Adam amplifies summation order).
TINY = [
    "trainer.epochs=3",
    "trainer.log_interval_steps=1",
    "trainer.progress_bar=false",
    "pipeline.balance=params",
    "pipeline.sharding=never",
    "autopipe.lambda_frozen=0.02",
    "freeze.strategy=manual",
    "freeze.interval_steps=null",
    "freeze.warmup_epochs=0",
    "optimizer.name=sgd",
    "optimizer.momentum=0.9",
    "optimizer.lr=0.05",
    "optimizer.weight_decay=0.0",
    "data.train_subset=192",
    "data.eval_subset=32",
]
SHIPPED = {
    # 4 processes, 18 units: 4 stages x 2 chunks; 5 frozen layers leave 7 active units
    # (2 x 2 chunks, 2 replicas), 7 leave 3 (DDP on 4).
    "quickstart": (
        "quickstart.yaml",
        4,
        [
            "pipeline.initial_pipe_len=4",
            "trainer.nproc_per_node=4",
            "freeze.manual_schedule=[5, 7]",
        ],
        [(4, 2), (2, 2), (1, 1)],
    ),
    # 2 processes (pipeline.initial_pipe_len=2), 10 units with the embedding frozen from the
    # start: 2 stages x 2 chunks, re-cut at 1 frozen layer, DDP at 3. A 4-layer BERT has no
    # shorter pipeline between: on 4 processes Eq. 2 keeps 2 stages at every boundary (the
    # frozen embedding stays with the first rank's chunks). No dropout: its random draws
    # differ between processes and one.
    "bert_sst2_local": (
        "bert_sst2_local.yaml",
        2,
        [
            "pipeline.initial_pipe_len=2",
            "trainer.nproc_per_node=2",
            "freeze.manual_schedule=[1, 3]",
            "model.kwargs.hidden_dropout_prob=0.0",
            "model.kwargs.attention_probs_dropout_prob=0.0",
        ],
        [(2, 2), (2, 2), (1, 1)],
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("config_name", list(SHIPPED))
def test_the_shipped_configs_train_through_their_transitions_as_one_process(
    tmp_path, sst2_dir, config_name
):
    """The quickstart and the BERT local config (SST-2 of several lengths: a stage per
    length bucket) under each chunked schedule through their transitions, every step's
    loss and the final weights equal to one process (the tolerances above). About 15 s a
    config on 2 cores: slow only to keep the default suite in its 5 minutes."""
    from pipetransformer.config import read_config_data

    path, world, overrides, layouts = SHIPPED[config_name]
    runs = []
    for schedule in ("interleaved_1f1b", "zero_bubble"):
        extra = [f"pipeline.schedule={schedule}", *overrides]
        if config_name == "bert_sst2_local":
            extra.append(f"data.root={sst2_dir}")
        runs.append((schedule, read_config_data(ROOT / "configs" / path, TINY + extra)))
    results = run_workers(elastic_runs, world, runs, str(tmp_path))
    for schedule, config_dict in runs:
        run_dir = tmp_path / schedule
        (start,) = events(run_dir, "start")
        kv = [(start["pipe_len"], start["virtual_stages"])] + [
            (e["new_pipe_len"], e["new_virtual_stages"]) for e in events(run_dir, "transition")
        ]
        assert kv == layouts, (schedule, kv)
        ref_losses, ref_state, _ = reference_run(config_from_dict(config_dict))
        assert step_losses(run_dir) == pytest.approx(ref_losses, abs=1e-5), schedule
        state, _ = results[0][schedule]["state"]
        assert set(state) == set(ref_state)
        for key, value in ref_state.items():
            torch.testing.assert_close(
                state[key],
                value,
                rtol=1e-4,
                atol=1e-5,
                msg=lambda m, key=key, schedule=schedule: f"{schedule} {key}: {m}",
            )
