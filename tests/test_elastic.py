"""Elastic training equals single-process training with the same freeze schedule.

4 gloo ranks go 1 pipeline x 4 stages -> 2 x 2 -> 4 x 1 (manual freeze schedule, SGD with
momentum), moving weights and momentum buffers at each transition. A plain single-process
loop over the same global batches, freezing the same layers at the same points, must give
the same loss at every step and the same final parameters. Tolerance: float32 summation
order only (micro-batches, all-reduce): 1e-5 absolute on losses, rtol 1e-4 / atol 1e-5 on
parameters.
"""

import json

import pytest
import torch
from helpers import assert_handoff_carried, run_workers
from reference import elastic_config, reference_run, step_losses
from workers import elastic_run, handoff_snapshots

from pipetransformer.autodp.sampler import TrainSampler
from pipetransformer.config import config_from_dict
from pipetransformer.data import build_data
from pipetransformer.models import build_model
from pipetransformer.trainer import optim
from pipetransformer.utils.units import parse_param_key

pytestmark = pytest.mark.distributed


def check_against_single_process(
    config_dict: dict, run_dir, results, autopipe: bool, layouts
) -> None:
    ref_losses, ref_state, _ = reference_run(config_from_dict(config_dict))
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(m["pipe_len"], m["dp_degree"]) for m in metrics] == layouts
    assert [m["num_frozen_layers"] for m in metrics] == [0, 3, 5]
    events = [
        e
        for e in map(json.loads, (run_dir / "events.jsonl").read_text().splitlines())
        if e["kind"] == "transition"
    ]
    assert len(events) == 2
    assert all(e["units_moved"] > 0 for e in events) == autopipe

    # Per step: the global batch's mean loss, reduced over the replicas.
    got = step_losses(run_dir)
    assert len(got) == len(ref_losses)
    for step, (a, b) in enumerate(zip(got, ref_losses)):
        assert a == pytest.approx(b, abs=1e-5), f"step {step}"

    state, _ = results[0]["state"]
    assert set(state) == set(ref_state)
    for name, value in ref_state.items():
        torch.testing.assert_close(
            state[name], value, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}"
        )
    # The frozen layers really stopped changing: they equal the reference, which froze them.
    assert results[0]["summary"]["final_num_frozen_layers"] == 5


def test_the_full_system_matches_single_process(elastic_full_run):
    """With layer-wise annealing (tests/conftest.py): the reference gives each layer the
    rate written out in reference.annealed_rate, so equal losses and weights through
    1x4 -> 2x2 -> 4x1 say that every rank's groups took their layer's rate after each
    handoff."""
    run = elastic_full_run  # shared with the resume tests (test_checkpoint.py)
    check_against_single_process(
        run.config_dict, run.run_dir, run.results, True, [(4, 1), (2, 2), (1, 4)]
    )


def test_each_layer_reaches_zero_at_its_planned_freeze_step(elastic_full_run):
    """manual [3, 5] at epoch ends of 7 steps: layers 0-2 freeze after step 7, 3-4 after
    step 14, layer 5 and the head train to the end on the run's schedule."""
    run_dir = elastic_full_run.run_dir
    planned = [7, 7, 7, 14, 14, None]
    steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    assert len(steps) == 21
    for record in steps:
        step, rates = record["global_step"], record["layer_lrs"]
        for layer, place in enumerate(planned):
            if place is None:
                assert rates[layer] == record["lr"]  # the run's schedule, as the head's
            elif step <= place:
                assert rates[layer] > 0, (step, layer)  # trained up to its freeze step
            else:
                assert rates[layer] == 0.0, (step, layer)
        frozen = sum(1 for place in planned if place is not None and step > place)
        assert record["num_frozen_layers"] == frozen  # frozen exactly when it reached zero
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    (start,) = [e for e in events if e["kind"] == "start"]
    assert start["planned_freeze_steps"] == planned
    decisions = [e for e in events if e["kind"] == "freeze_decision"]
    assert [
        (d["rule_num_frozen_layers"], d["planned_num_frozen_layers"], d["new_num_frozen_layers"])
        for d in decisions
    ] == [(3, 3, 3), (5, 5, 5)]
    assert all(d["planned_freeze_steps"] == planned for d in decisions)


@pytest.mark.parametrize(
    "autopipe, autodp, clip, layouts",
    [
        # The ablations' layouts, slow for the default suite's 5 minutes (each a 4-rank run
        # of 21 steps beside its reference: 7-8 s on 2 shared cores, about 4 s idle): freeze
        # only, frozen units stay in their stages; no AutoDP, freed ranks idle.
        pytest.param(False, True, None, [(4, 1), (4, 1), (4, 1)], marks=pytest.mark.slow),
        pytest.param(True, False, None, [(4, 1), (2, 1), (1, 1)], marks=pytest.mark.slow),
        # Global-norm clipping over a pipeline's stages (small enough to clip every step).
        (True, True, 0.05, [(4, 1), (2, 2), (1, 4)]),
    ],
    ids=["freeze_only", "no_autodp", "full_clipped"],
)
def test_elastic_run_matches_single_process(tmp_path, autopipe, autodp, clip, layouts):
    config_dict = elastic_config(autopipe__enabled=autopipe, optimizer__max_grad_norm=clip)
    config_dict["autodp"] = {"enabled": autodp}
    results = run_workers(elastic_run, 4, config_dict, str(tmp_path))
    check_against_single_process(config_dict, tmp_path, results, autopipe, layouts)


def test_state_handoff_is_bit_exact(tmp_path):
    """Weights, Adam moments and step counts arrive unchanged wherever they move (between
    layouts of several chunks a stage: tests/test_chunked_training.py)."""
    config_dict = elastic_config(
        trainer__epochs=1,
        optimizer__name="adamw",
        optimizer__weight_decay=0.01,
        freeze__strategy="none",
        freeze__manual_schedule=[],
    )
    # Units of about 1 MiB (3 with their Adam moments), so the move's memory is measurable.
    config_dict["model"]["kwargs"].update(embed_dim=256, num_heads=4)
    results = run_workers(handoff_snapshots, 4, config_dict, str(tmp_path), [3, 5])
    for phase in range(1, 3):
        before = [r[phase - 1] for r in results]
        after = [r[phase] for r in results]
        # The old runtime (DDP buckets, pipeline buffers) is gone before the new one is built.
        # (None on a rank that held no runtime.)
        had_runtime = [a[2] for a in after if a[2] is not None]
        assert had_runtime and not any(had_runtime), (phase, had_runtime)
        # What the unit move held above the old stage, against the memory model: within a
        # quarter, or 1 MiB where the rank moved little (pickled manifests, gloo's buffers).
        for rank, (_, _, _, (measured, predicted)) in enumerate(after):
            assert abs(measured - predicted) <= max(0.25 * predicted, 2**20), (
                phase,
                rank,
                measured,
                predicted,
            )
        checked_moves = assert_handoff_carried(before, after)
        frozen_units = after[0][0].plan.frozen_end
        for _, state, _, _ in after:
            for name, (param, _) in state.items():
                if parse_param_key(name)[0] < frozen_units:
                    assert not param.requires_grad, name
        assert checked_moves > 0  # some state really moved between ranks


def reference_grad_norms(config, epochs_before_decision=1):
    """Per-layer RMS gradient norm over the first epoch, single process."""
    import math

    from pipetransformer.utils.units import layer_of_unit

    data = build_data(config.data, seed=config.trainer.seed)
    torch.manual_seed(config.trainer.seed)
    model = build_model(
        config.model, task="classification", num_classes=10, in_chans=1, image_size=8
    )
    named = {
        f"units.{i}.{n}": p for i, u in enumerate(model.units) for n, p in u.named_parameters()
    }
    optimizer = optim.build_optimizer(config.optimizer, named)
    sampler = TrainSampler(
        len(data.train), 1, config.trainer.global_batch_size, config.trainer.seed
    )
    total = config.trainer.epochs * sampler.steps_per_epoch
    sums = [0.0] * model.spec.num_layers
    for s in range(sampler.steps_per_epoch):
        batch = sampler.node_batch(0, 0, s)
        (images,), labels = data.train.fetch(batch.ids)
        valid = torch.tensor(batch.valid)
        loss = (
            torch.nn.functional.cross_entropy(model(images), labels, reduction="none") * valid
        ).sum() / valid.sum()
        optim.set_learning_rate(optimizer, optim.learning_rate(config.optimizer, s, total))
        loss.backward()
        for i, unit in enumerate(model.units):
            layer = layer_of_unit(i, model.spec.num_layers)
            if layer is not None:
                sums[layer] += sum(float(p.grad.double().pow(2).sum()) for p in unit.parameters())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return [math.sqrt(v / sampler.steps_per_epoch) for v in sums]


def test_gradient_norm_decisions_are_reduced_and_identical_on_all_ranks(tmp_path):
    config_dict = elastic_config(
        trainer__epochs=2,
        pipeline__initial_pipe_len=2,
        freeze__strategy="gradient_norm",
        freeze__alpha=0.5,
        freeze__manual_schedule=[],
    )
    config = config_from_dict(config_dict)
    expected_norms = reference_grad_norms(config)
    results = run_workers(elastic_run, 4, config_dict, str(tmp_path))  # 2 replicas x 2 stages
    decisions = [
        [(t.new_num_frozen_layers, t.layer_grad_norms) for t in r["transitions"]] for r in results
    ]
    assert all(d == decisions[0] for d in decisions), "every rank decides the same"
    assert len(decisions[0]) == 1
    frozen, norms = decisions[0][0]
    assert norms == pytest.approx(expected_norms, rel=1e-4)
    from pipetransformer.freeze import gradient_norm_outcome

    assert frozen == gradient_norm_outcome(0, expected_norms, 0.5, 5).num_frozen_layers > 0
