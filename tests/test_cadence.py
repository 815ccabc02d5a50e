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
