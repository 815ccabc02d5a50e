"""The decision cadence and the micro-batch count. 'auto' (the default) is a function of the
config: an idle run, a run on a busy machine and a resumed run decide alike.
freeze.interval_steps 'measured' (opt-in): measured once, at the first transition, kept for
the run (resumes included), and said: an event, a log line with how to pin it, a warning
when no decision is left (a 16-rank run once took no decision after its first, silently)."""

import logging

import pytest

from pipetransformer.autodp.control import Control
from pipetransformer.config import config_from_dict
from pipetransformer.runs.state import RunState
from pipetransformer.trainer.freezing import FreezeControl


def control_for(interval, state: RunState) -> FreezeControl:
    config = config_from_dict(
        {
            "trainer": {"epochs": 3, "nproc_per_node": 1},
            "freeze": {
                "strategy": "manual",
                "manual_schedule": [1, 2, 3],
                "interval_steps": interval,
            },
            "model": {"kwargs": {"depth": 4}},
        }
    )
    return FreezeControl(config, 4, 12, state, metrics=None, control=Control(None))


def test_measured_spaces_decisions_once_and_a_resume_keeps_the_interval(caplog):
    state = RunState()
    freezer = control_for("measured", state)
    assert freezer.schedule.interval_steps == 4  # three decisions an epoch of 12 steps
    with caplog.at_level(logging.INFO, logger="pipetransformer"):
        event = freezer.space(transition_s=0.2, step_s=0.1, global_step=4)
    # A transition may take 5% of the time between decisions: 0.2 / (0.05 x 0.1) = 40 steps.
    assert (event.interval_steps, event.default_interval_steps) == (40, 4)
    assert freezer.schedule.interval_steps == 40 and state.decision_interval_measured
    assert event.decisions_left == (36 - 1 - 4) // 40 == 0
    assert "freeze.interval_steps=40" in caplog.text and "no freeze decision is left" in caplog.text
    assert "load" in caplog.text  # says that what it measured depends on the machine's load
    # Measured once: a later, slower transition changes nothing ...
    assert freezer.space(transition_s=5.0, step_s=0.1, global_step=8) is None
    assert freezer.schedule.interval_steps == 40
    # ... and a resume (the run state from a checkpoint) starts at the same interval.
    assert control_for("measured", state).schedule.interval_steps == 40


def test_a_cheap_transition_keeps_the_default_and_other_cadences_are_not_measured():
    freezer = control_for("measured", RunState())
    event = freezer.space(transition_s=0.001, step_s=0.1, global_step=4)
    assert event.interval_steps == 4 and event.decisions_left == (35 - 4) // 4
    # 'auto' is three decisions an epoch whatever a transition costs: no clock decides it.
    for setting in ("auto", 6, None):
        state = RunState()
        freezer = control_for(setting, state)
        before = freezer.schedule
        assert freezer.space(5.0, 0.1, 4) is None and freezer.schedule == before
        assert not state.decision_interval_measured


def test_the_defaults_decide_alike_idle_under_load_and_after_a_resume(tmp_path):
    """The same config and seed with the default cadence and micro-batch count ('auto'
    both): a run whose clock gains 20 ms at every reading (a busy machine: what a run
    times, transitions most, looks slower) and a run resumed from a checkpoint after the
    first transition, itself under that load, freeze at the same steps, the same layers and
    micro-batch counts, with the same losses and final metric, as the idle run. Before
    issue 42 'auto' measured both, and the loaded run froze at other steps. Three short
    2-process runs in one worker start (about 10 s)."""
    import json

    from helpers import run_workers
    from reference import elastic_config
    from test_checkpoint import events, step_losses
    from workers import runs_under_load

    config = elastic_config(
        trainer__nproc_per_node=2,
        pipeline__initial_pipe_len=2,
        pipeline__num_micro_batches="auto",
        freeze__strategy="gradient_norm",
        freeze__interval_steps="auto",
        checkpoint__interval_steps=9,
        checkpoint__keep_last=20,
    )
    resume_at = 9  # a checkpoint after the first transition
    runs = [("idle", config, 0.0, None), ("loaded", config, 0.02, None)]
    runs.append(("resumed", config, 0.02, resume_at))
    run_workers(runs_under_load, 2, runs, str(tmp_path))

    def trajectory(run_dir):
        return [
            (
                e["global_step"],
                e["new_num_frozen_layers"],
                e["new_pipe_len"],
                e["num_micro_batches"],
            )
            for e in events(run_dir, "transition")
        ]

    idle = tmp_path / "idle"
    assert trajectory(idle) and trajectory(idle)[0][0] < resume_at
    assert all(m == k for _, _, k, m in trajectory(idle))  # the smallest M >= K dividing 16
    assert not events(idle, "cadence")  # nothing measured the interval
    assert events(idle, "start")[0]["decided_by_measured_time"] == []
    for other in ("loaded", "resumed"):
        assert trajectory(tmp_path / other) == trajectory(idle), other
        assert step_losses(tmp_path / other) == step_losses(idle), other
    summary = [json.loads((tmp_path / d / "summary.json").read_text()) for d, *_ in runs]
    assert len({s["final_eval_metric"] for s in summary}) == 1


@pytest.mark.slow
def test_a_resumed_run_decides_at_the_same_steps_as_the_uninterrupted_one(tmp_path):
    """The paper's rule with the measured cadence and micro-batch count (opt-in: 'measured'
    both; the start event says so): a run resumed from a checkpoint taken after its first
    transition freezes at the same steps, the same layers, and ends with the same metric as
    the run that was not interrupted. Slow (about 14 s: two 2-process runs); the default
    ('auto') is checked in the default suite above."""
    import json

    from helpers import run_workers
    from reference import elastic_config
    from test_checkpoint import RESUME, continue_from, events, step_losses
    from workers import elastic_run

    config = elastic_config(
        trainer__nproc_per_node=2,
        pipeline__initial_pipe_len=2,
        pipeline__num_micro_batches="measured",
        freeze__strategy="gradient_norm",
        freeze__interval_steps="measured",
        checkpoint__interval_steps=3,
        checkpoint__keep_last=20,
    )
    full = tmp_path / "full"
    run_workers(elastic_run, 2, config, str(full))
    transitions = events(full, "transition")
    (cadence,) = events(full, "cadence")
    assert transitions and cadence["global_step"] == transitions[0]["global_step"]
    measured = ["pipeline.num_micro_batches", "freeze.interval_steps"]
    assert events(full, "start")[0]["decided_by_measured_time"] == measured
    resume_at = ((transitions[0]["global_step"] // 3) + 1) * 3  # the next checkpoint after it
    resumed = tmp_path / "resumed"
    continue_from(full, resumed, resume_at)
    run_workers(elastic_run, 2, config, str(resumed), False, RESUME)

    def trajectory(run_dir):
        return [
            (e["global_step"], e["new_num_frozen_layers"], e["num_micro_batches"])
            for e in events(run_dir, "transition")
        ]

    assert trajectory(resumed) == trajectory(full)
    assert step_losses(resumed) == step_losses(full)
    summary = [json.loads((d / "summary.json").read_text()) for d in (full, resumed)]
    assert summary[0]["final_eval_metric"] == summary[1]["final_eval_metric"]
    assert summary[1]["decision_interval_steps"] == cadence["interval_steps"]


def test_settings_under_which_nothing_can_freeze_are_said(caplog):
    """A 3-epoch quickstart with its 18 warm-up epochs froze nothing and said nothing."""
    state = RunState()
    config = config_from_dict(
        {
            "trainer": {"epochs": 3, "nproc_per_node": 1},
            "freeze": {"strategy": "gradient_norm", "warmup_epochs": 18},
        }
    )
    with caplog.at_level(logging.WARNING, logger="pipetransformer"):
        FreezeControl(config, 4, 12, state, None, Control(None)).warn_if_nothing_can_freeze()
    assert "nothing will freeze" in caplog.text and "warmup_epochs 18" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pipetransformer"):
        control_for("auto", RunState()).warn_if_nothing_can_freeze()
    assert caplog.text == ""


def test_the_baseline_has_no_decision_point():
    """freeze.strategy none (the baseline, DDP, the peers) never asks the freeze algorithm:
    no decision point, so no collective to agree on zero frozen layers, at any step."""
    from types import SimpleNamespace

    from pipetransformer.trainer.clock import Tick

    config = config_from_dict(
        {
            "trainer": {"epochs": 3, "nproc_per_node": 1},
            "freeze": {"strategy": "none"},
            "model": {"kwargs": {"depth": 4}},
        }
    )
    metrics = SimpleNamespace(steps_since_decision=100)
    freezer = FreezeControl(config, 4, 12, RunState(), metrics=metrics, control=Control(None))
    ticks = [
        Tick(epoch=s // 12, step_in_epoch=s % 12, global_step=s + 1, steps_per_epoch=12, epochs=3)
        for s in range(36)
    ]
    assert not any(freezer.due(tick) for tick in ticks)
    manual = control_for("auto", RunState())
    manual.metrics = metrics
    assert any(manual.due(tick) for tick in ticks)  # the same ticks, a freezing rule
