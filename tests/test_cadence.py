"""freeze.interval_steps 'auto': measured once, at the first transition, kept for the run
(resumes included), and said: an event, a log line with how to pin it, a warning when no
decision is left (a 16-rank run once took no decision after its first, silently)."""

import logging

from pipetransformer.config import config_from_dict
from pipetransformer.trainer.control import Control
from pipetransformer.trainer.freezing import FreezeControl
from pipetransformer.trainer.state import RunState


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


def test_auto_spaces_decisions_once_and_a_resume_keeps_the_interval(caplog):
    state = RunState()
    freezer = control_for("auto", state)
    assert freezer.schedule.interval_steps == 4  # three decisions an epoch of 12 steps
    with caplog.at_level(logging.INFO, logger="pipetransformer"):
        event = freezer.space(transition_s=0.2, step_s=0.1, global_step=4)
    # A transition may take 5% of the time between decisions: 0.2 / (0.05 x 0.1) = 40 steps.
    assert (event.interval_steps, event.default_interval_steps) == (40, 4)
    assert freezer.schedule.interval_steps == 40 and state.decision_interval_measured
    assert event.decisions_left == (36 - 1 - 4) // 40 == 0
    assert "freeze.interval_steps=N" in caplog.text and "no freeze decision is left" in caplog.text
    # Measured once: a later, slower transition changes nothing ...
    assert freezer.space(transition_s=5.0, step_s=0.1, global_step=8) is None
    assert freezer.schedule.interval_steps == 40
    # ... and a resume (the run state from a checkpoint) starts at the same interval.
    assert control_for("auto", state).schedule.interval_steps == 40


def test_a_cheap_transition_keeps_the_default_and_fixed_cadences_are_not_measured():
    freezer = control_for("auto", RunState())
    event = freezer.space(transition_s=0.001, step_s=0.1, global_step=4)
    assert event.interval_steps == 4 and event.decisions_left == (35 - 4) // 4
    for setting in (6, None):
        assert control_for(setting, RunState()).space(5.0, 0.1, 4) is None


def test_a_resumed_run_decides_at_the_same_steps_as_the_uninterrupted_one(tmp_path):
    """The paper's rule with the measured cadence and micro-batch count ('auto' both): a run
    resumed from a checkpoint taken after its first transition freezes at the same steps, the
    same layers, and ends with the same metric as the run that was not interrupted."""
    import json

    from helpers import run_workers
    from reference import elastic_config
    from test_checkpoint import RESUME, continue_from, events, step_losses
    from workers import elastic_run

    config = elastic_config(
        trainer__nproc_per_node=2,
        pipeline__initial_pipe_len=2,
        pipeline__num_micro_batches="auto",
        freeze__strategy="gradient_norm",
        freeze__interval_steps="auto",
        checkpoint__interval_steps=3,
        checkpoint__keep_last=20,
    )
    full = tmp_path / "full"
    run_workers(elastic_run, 2, config, str(full))
    transitions = events(full, "transition")
    (cadence,) = events(full, "cadence")
    assert transitions and cadence["global_step"] == transitions[0]["global_step"]
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
