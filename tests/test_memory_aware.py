"""freeze.memory_aware: of the layers the rule would freeze, only the fewest that change the
layout (fewer stages or more replicas), none where no count the rule allows does; decided
from the planned layouts, so a run makes the same decisions as a run told those counts."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
from helpers import run_workers
from reference import elastic_config, step_losses
from workers import elastic_runs

from pipetransformer.autodp.control import Control
from pipetransformer.config import ConfigError, World, config_from_dict
from pipetransformer.freeze import (
    AGREE,
    BOUND,
    LAYOUT,
    FreezeOutcome,
    counts_that_pay,
    fewest_that_pay,
)
from pipetransformer.planning.context import PlanContext, describe_model
from pipetransformer.runs.state import RunState
from pipetransformer.trainer.freezing import FreezeControl


def test_fewest_that_pay_takes_the_smallest_paying_count_up_to_the_rules():
    wants_five = FreezeOutcome(5, 5, 5, 5, AGREE)
    packs_from = lambda first: lambda count: count >= first  # noqa: E731
    assert fewest_that_pay(wants_five, 1, packs_from(3)) == FreezeOutcome(3, 5, 5, 5, LAYOUT)
    # Nothing up to the rule's count pays: nothing freezes, and the layout said so.
    held = fewest_that_pay(FreezeOutcome(2, 4, 2, 5, BOUND), 0, packs_from(3))
    assert (held.num_frozen_layers, held.decided_by, held.proposed) == (0, LAYOUT, 4)
    # The rule's own count is the first that pays: the rule's outcome, unchanged.
    assert fewest_that_pay(wants_five, 2, packs_from(5)) == wants_five
    # A rule that freezes nothing more asks nothing.
    unchanged = FreezeOutcome(2, 2, 3, 5, AGREE)
    assert fewest_that_pay(unchanged, 2, lambda count: pytest.fail("asked")) == unchanged


def test_counts_that_pay_where_a_pipeline_packs_and_where_every_process_is_a_replica():
    """What a run records at its start (`FreezeControl.counts_that_pay`): from a 2-stage pipeline
    of 6 layers the counts that pack it; from 1 stage x 2 replicas (the model fits a
    process) none, so no layer will freeze there."""
    config = config_from_dict(ground(freeze__manual_schedule=[3], freeze__memory_aware=True))
    plan = PlanContext.build(config, describe_model(config), World(2, 2))

    def pays_from(pipe_len):
        old = plan.layout_for(0, pipe_len)
        return lambda count: (
            (new := plan.layout_for(count, pipe_len)).pipe_len < old.pipe_len
            or new.dp_degree > old.dp_degree
        )

    assert counts_that_pay(0, 5, pays_from(2)) == [4, 5]
    assert counts_that_pay(0, 5, pays_from(1)) == []


def test_the_start_line_says_which_counts_pay_or_why_none_does(caplog):
    """The three things a memory-aware run can say at its start: the counts that change its
    layout; that one stage of replicas is final (no decision is taken); or that its pipeline
    is one no count up to freeze.max_frozen_layers packs (decisions are taken, and held)."""
    config = config_from_dict(ground(freeze__manual_schedule=[3], freeze__memory_aware=True))

    def start(pipe_len, dp_degree, packs_from, layout_final=False):
        freezer = FreezeControl(
            config, 6, 10, RunState(), None, Control(None), layout_final=layout_final
        )
        layout = SimpleNamespace(
            pipe_len=pipe_len, dp_degree=dp_degree, plan=SimpleNamespace(num_frozen_layers=0)
        )
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="pipetransformer"):
            paying = freezer.counts_that_pay(layout, lambda _: lambda count: count >= packs_from)
        return paying, freezer.idle, caplog.text

    paying, idle, said = start(2, 1, packs_from=4)
    assert (paying, idle) == ([4, 5], False) and "freezing 4, 5 layers changes" in said
    paying, idle, said = start(1, 2, packs_from=1, layout_final=True)
    assert (paying, idle) == ([], True) and "no decision is taken" in said
    paying, idle, said = start(2, 1, packs_from=9)
    assert (paying, idle) == ([], False)
    assert "no count of frozen layers up to 5 (freeze.max_frozen_layers)" in said
    assert "one stage with every process a replica" not in said


def test_memory_aware_refuses_layerwise_annealing():
    with pytest.raises(ConfigError, match="optimizer.layerwise_anneal: freeze.memory_aware"):
        config_from_dict(
            {
                "freeze": {"strategy": "manual", "manual_schedule": [1], "memory_aware": True},
                "optimizer": {"layerwise_anneal": True},
            }
        )


def ground(**changes) -> dict:
    """2 ranks from a 2-stage pipeline that packs into 1 stage x 2 replicas at 4 frozen
    layers of 6 (Eq. 2 on parameter sizes); decisions at the ends of epochs 1 and 2."""
    changes = {"trainer__nproc_per_node": 2, "pipeline__initial_pipe_len": 2, **changes}
    return elastic_config(**changes)


def test_a_memory_aware_run_freezes_only_where_the_pipeline_packs(tmp_path):
    """The rule asks for 3 then 5 layers: 3 packs nothing (nothing freezes), 4 is the fewest
    that packs (4 freeze, not 5). The run equals, loss for loss, a run told 0 then 4.
    Started as 1 stage x 2 replicas, which no count changes, the same rule takes no
    decision and starts no AutoCache daemon, and trains loss for loss as the run told to
    freeze nothing there. Each start event records the counts that pay."""
    aware = ground(freeze__manual_schedule=[3, 5], freeze__memory_aware=True)
    config = config_from_dict(aware)
    plan = PlanContext.build(config, describe_model(config), World(2, 2))
    packs = [plan.layout_for(count, 2).pipe_len == 1 for count in range(6)]
    assert packs == [False] * 4 + [True] * 2
    told = ground(freeze__manual_schedule=[0, 4])
    as_ddp = dict(pipeline__initial_pipe_len=1, pipeline__num_micro_batches=1)
    idle = ground(freeze__manual_schedule=[3, 5], freeze__memory_aware=True, **as_ddp)
    idle["cache"] = {"enabled": True}
    told_nothing = ground(freeze__manual_schedule=[0, 0], **as_ddp)
    runs = [("aware", aware), ("told", told), ("idle", idle), ("told_nothing", told_nothing)]
    results = run_workers(elastic_runs, 2, runs, str(tmp_path))
    events = [json.loads(line) for line in (tmp_path / "aware" / "events.jsonl").open()]
    decisions = [e for e in events if e["kind"] == "freeze_decision"]
    assert [(d["new_num_frozen_layers"], d["decided_by"]) for d in decisions] == [
        (0, LAYOUT),
        (4, LAYOUT),
    ]
    layouts = [
        (m["num_frozen_layers"], m["pipe_len"], m["dp_degree"])
        for m in map(json.loads, (tmp_path / "aware" / "metrics.jsonl").open())
    ]
    assert layouts == [(0, 2, 1), (0, 2, 1), (4, 1, 2)]
    assert step_losses(tmp_path / "aware") == step_losses(tmp_path / "told")
    assert results[0]["aware"]["summary"]["final_num_frozen_layers"] == 4

    def start(name):
        (found,) = [e for e in events(name) if e["kind"] == "start"]
        return found

    def events(name):
        return [json.loads(line) for line in (tmp_path / name / "events.jsonl").open()]

    assert start("aware")["freeze_counts_that_pay"] == [4, 5]
    assert start("told")["freeze_counts_that_pay"] is None  # not memory-aware
    idle_start = start("idle")
    assert idle_start["freeze_counts_that_pay"] == [] and idle_start["cache_daemons"] == []
    assert (idle_start["pipe_len"], idle_start["dp_degree"]) == (1, 2)
    assert not [e for e in events("idle") if e["kind"] == "freeze_decision"]
    assert len([e for e in events("told_nothing") if e["kind"] == "freeze_decision"]) == 2
    assert step_losses(tmp_path / "idle") == step_losses(tmp_path / "told_nothing")
    assert results[0]["idle"]["summary"]["final_num_frozen_layers"] == 0
    assert results[0]["idle"]["summary"]["freeze_idle"]
    assert not results[0]["aware"]["summary"]["freeze_idle"]
