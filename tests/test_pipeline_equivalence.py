"""A K-stage pipeline (x R replicas with DDP) computes the gradients of single-process training,
text at several sequence lengths in a row (each a stage and schedule of its own, built the
first time the length comes, over the same DDP module; workers.step_lengths), padded or
packed (data.padding packed: each step one packed shape, rows for samples).

Tolerance: float32 sums in another order (micro-batches, DDP's all-reduce) differ by
rounding only: gradients agree to rtol 1e-4 / atol 1e-6, losses to 1e-5.
"""

import pytest
import torch
from helpers import run_workers
from workers import (
    build,
    cut,
    fixed_batch,
    one_stage_against_gpipe,
    pipeline_gradients,
    pipeline_gradients_ddp_everywhere,
    reference_gradients,
    step_lengths,
)

from pipetransformer.config import SPLIT_BACKWARD_SCHEDULES, TORCH_SCHEDULE_CLASS
from pipetransformer.utils.units import parse_param_key

pytestmark = pytest.mark.distributed

CASES = [
    # kind, pipe_len, dp_degree, micro-batches, schedule, chunks a stage
    ("vit", 2, 1, 4, "gpipe", 1),
    ("vit", 4, 1, 4, "1f1b", 1),
    ("vit", 2, 2, 2, "gpipe", 1),
    ("bert", 2, 1, 2, "gpipe", 1),
    ("bert", 2, 2, 2, "1f1b", 1),
    # 4 chunks on 2 ranks (torch's multi-stage schedules), alone and replicated: DDP on each
    # chunk under interleaved 1F1B, the rank's own all-reduce under zero bubble. Replicated
    # they run through the trainer too (tests/test_chunked_training.py's 2 x 2 layouts), so
    # here they are slow, for the default suite's 5 minutes (about 2 s each).
    ("vit", 2, 1, 4, "interleaved_1f1b", 2),
    ("bert", 2, 1, 2, "zero_bubble", 2),
    pytest.param("bert", 2, 2, 2, "interleaved_1f1b", 2, marks=pytest.mark.slow),
    pytest.param("bert", 2, 2, 4, "zero_bubble", 2, marks=pytest.mark.slow),
]


@pytest.mark.parametrize(
    "kind, pipe_len, dp_degree, micro, schedule, chunks", CASES, ids=lambda v: str(v)
)
def test_pipeline_matches_single_process(kind, pipe_len, dp_degree, micro, schedule, chunks):
    batch = 16
    ref_loss, ref_grads = reference_gradients(kind, batch)
    results = run_workers(
        pipeline_gradients,
        pipe_len * dp_degree,
        kind,
        pipe_len,
        dp_degree,
        micro,
        schedule,
        batch,
        None,
        chunks,
    )
    covered = set()
    for result in results:
        for name, grad in result["grads"].items():
            torch.testing.assert_close(
                grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}"
            )
            covered.add(name)
        assert result["stage_classes"] == [TORCH_SCHEDULE_CLASS[schedule]]
        assert result["host_reads"] == []  # the steps after the first (gpu_audit.HostReads)
        # Who averages the replicas' gradients: DDP around each chunk, or the rank itself.
        by_hand = dp_degree > 1 and schedule in SPLIT_BACKWARD_SCHEDULES
        assert result["by_hand"] == by_hand
        assert result["ddp_chunks"] == (0 if by_hand or dp_degree == 1 else chunks)
    assert covered == set(ref_grads), "every parameter lives on some rank"
    # Each last stage returns its micro-batch losses weighted by R / batch: their total over
    # replicas is R times the mean loss (summed over the steps).
    total = sum(sum(r["losses"]) for r in results if r["role"].is_last)
    assert total / dp_degree == pytest.approx(ref_loss, rel=1e-5)
    if kind == "bert" and pipe_len > 1:  # a stage for each length, the first one reused
        assert all(r["lengths_built"] == [16, 8] for r in results)
    # The first training step after an evaluation is any other step: the bucket's stages
    # and buffers reused, no warm-up vote (torch re-initialises a schedule that switches
    # between eval and step; evaluation has stages of its own).
    for result in results:
        after_eval, steady = result["after_eval"]
        assert after_eval == steady, (result["rank"], after_eval, steady)
        assert "warm_up_votes" not in steady and "forward_set_ups" not in steady
        if pipe_len > 1:
            assert steady["p2p_sends"] + steady["p2p_recvs"] > 0
    # Evaluation through the forward-only schedule: each replica's logits are the model's.
    model = build(kind).eval()
    inputs, _ = fixed_batch(kind, batch)
    with torch.no_grad():
        expected = model(*cut(inputs, step_lengths(kind)[0]))
    evaluated = [r["eval_logits"] for r in results if r["role"].is_last]
    assert len(evaluated) == dp_degree
    for window, logits in evaluated:
        torch.testing.assert_close(logits, expected[window], rtol=1e-5, atol=1e-6)


def test_ddp_would_miss_zero_bubbles_weight_gradients():
    """Why zero bubble averages the replicas' gradients itself (pipe/gradient_sync.py): with
    each chunk wrapped in DDP as interleaved 1F1B's are, torch 2.14's split backward writes
    the weight gradients past DDP's hooks, and every chunk but the first keeps its replica's
    own gradient (no error; ViT, one step, 2 stages x 2 chunks x 2 replicas). If this fails,
    torch syncs them now: the all-reduce of our own may give way to DDP."""
    batch = 16
    _, ref_grads = reference_gradients("vit", batch)
    results = run_workers(
        pipeline_gradients_ddp_everywhere, 4, "vit", 2, 2, 2, "zero_bubble", batch, None, 2
    )
    wrong = set()
    for result in results:
        assert result["ddp_chunks"] == 2 and not result["by_hand"]
        for name, grad in result["grads"].items():
            if not torch.allclose(grad, ref_grads[name], rtol=1e-4, atol=1e-6):
                wrong.add(name)
    first_chunk = set(results[0]["first_chunk_units"])  # its W is a whole backward
    assert wrong == {n for n in ref_grads if parse_param_key(n)[0] not in first_chunk}


def assert_gradients_match(results, ref_grads) -> None:
    covered = set()
    for result in results:
        for name, grad in result["grads"].items():
            torch.testing.assert_close(
                grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}"
            )
            covered.add(name)
        assert result["host_reads"] == []
    assert covered == set(ref_grads), "every parameter lives on some rank"


def test_replicas_of_a_pipeline_in_different_buckets_in_the_same_step():
    """2 stages x 2 replicas, each replica's batch of a step in another length bucket (16 and
    8 tokens, then 8 and 16): each pipeline builds its own bucket's stages around the same
    DDP module, whose all-reduce sums gradients computed at different lengths. Equal to the
    whole model (sentences of 2-6 tokens: any of the buckets holds them)."""
    batch = 16
    ref_loss, ref_grads = reference_gradients("bert-short", batch)
    results = run_workers(
        pipeline_gradients, 4, "bert-short", 2, 2, 2, "1f1b", batch, None, 1, False, True
    )
    assert_gradients_match(results, ref_grads)
    built = {r["role"].replica: r["lengths_built"] for r in results}
    assert built == {0: [16, 8], 1: [8, 16]}  # the same step, another bucket
    total = sum(sum(r["losses"]) for r in results if r["role"].is_last)
    assert total / 2 == pytest.approx(ref_loss, rel=1e-5)


@pytest.mark.parametrize(
    "pipe_len, dp_degree, micro, schedule, chunks",
    [(2, 2, 2, "1f1b", 1), (2, 1, 2, "zero_bubble", 2)],
    ids=["2x2-1f1b", "2-stages-4-chunks-zero_bubble"],
)
def test_a_packed_pipeline_matches_single_process(pipe_len, dp_degree, micro, schedule, chunks):
    """Packed text through a pipeline of replicas (each replica of a step in another shape),
    and through torch's multi-stage schedule: the gradients, losses and evaluated logits of
    the whole model on the batches padded. Each step is one packed shape (micro-batches of
    rows, the last stage's outputs one a sample); a shape met again reuses its stage (no
    host read in that step). Sentences of 2-6 tokens, so rows of 8 and 16 hold several."""
    batch = 16
    ref_loss, ref_grads = reference_gradients("bert-short", batch)
    results = run_workers(
        pipeline_gradients,
        pipe_len * dp_degree,
        "bert-short",
        pipe_len,
        dp_degree,
        micro,
        schedule,
        batch,
        None,
        chunks,
        True,
        dp_degree > 1,
    )
    assert_gradients_match(results, ref_grads)
    for result in results:
        shapes = result["lengths_built"]  # one shape at 16 tokens, one at 8
        first = [16, 8] if result["role"].replica == 0 else [8, 16]
        assert [s.row_length for s in shapes] == first
        assert all(s.samples == batch // dp_degree // micro for s in shapes)
        assert min(s.rows for s in shapes) < shapes[0].samples  # rows hold several samples
    total = sum(sum(r["losses"]) for r in results if r["role"].is_last)
    assert total / dp_degree == pytest.approx(ref_loss, rel=1e-5)
    model = build("bert-short").eval()
    inputs, _ = fixed_batch("bert-short", batch)
    with torch.no_grad():
        expected = model(*cut(inputs, step_lengths("bert-short")[0]))
    for window, logits in (r["eval_logits"] for r in results if r["role"].is_last):
        torch.testing.assert_close(logits, expected[window], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind, dp_degree", [("vit", 1), ("bert", 2)])
def test_bf16_pipeline_matches_single_process_bf16(kind, dp_degree):
    """bf16 autocast: a 2-stage pipeline against the whole model under the same autocast.
    They differ by the bfloat16 rounding of the hidden state at the stage boundary and by
    summation order: each gradient tensor within 2% of its norm plus 0.2% of the whole
    gradient's norm (gradients that are zero in exact arithmetic, such as BERT's key bias,
    are rounding noise on both sides), the loss within 0.5%."""
    batch = 16
    ref_loss, ref_grads = reference_gradients(kind, batch, torch.bfloat16)
    results = run_workers(
        pipeline_gradients, 2 * dp_degree, kind, 2, dp_degree, 2, "gpipe", batch, torch.bfloat16
    )
    whole = torch.cat([g.flatten() for g in ref_grads.values()]).norm()
    covered = set()
    for result in results:
        assert result["linear_dtypes"] == {torch.bfloat16}  # every stage computes in bf16
        for name, grad in result["grads"].items():
            assert grad.dtype == torch.float32  # float32 master weights and gradients
            error = (grad - ref_grads[name]).norm()
            bound = 2e-2 * ref_grads[name].norm() + 2e-3 * whole
            assert error < bound, f"{name}: error {error:.3g}, bound {bound:.3g}"
            covered.add(name)
    assert covered == set(ref_grads)
    total = sum(sum(r["losses"]) for r in results if r["role"].is_last)
    assert total / dp_degree == pytest.approx(ref_loss, rel=5e-3)


def test_a_one_stage_layout_runs_what_gpipe_runs():
    """A layout of one stage skips the pipelining machinery (OneStageSchedule): its step equals
    PipelineStage + ScheduleGPipe's around the same DDP module, bit for bit (losses and the
    all-reduced gradients of 2 micro-batches on each of 2 ranks), and its units train even
    when the profiler left them in eval mode.

    In the same run, zero bubble's own averaging (pipe/gradient_sync.py, which replaces DDP
    under a split backward), unclipped: the same step on the units without DDP, then
    `GradientAllReduce`, gives DDP's gradients on both ranks (the average: a sum would be
    twice them; a clipped update would not tell the two apart). And a trained parameter
    whose gradient one replica lacks: both ranks still send the same buffer and leave with
    the same gradients, the missing one counted as zero (half the other rank's)."""
    results = run_workers(one_stage_against_gpipe, 2, "bert", 2, 8)
    for result in results:
        assert all(result["modes"])
        (one_losses, one_grads), (gpipe_losses, gpipe_grads) = result["one_stage"], result["gpipe"]
        assert one_losses == gpipe_losses and len(one_losses) == 2
        assert one_grads.keys() == gpipe_grads.keys()
        for name in one_grads:
            assert torch.equal(one_grads[name], gpipe_grads[name]), name
        averaged = result["gradient_all_reduce"]
        assert averaged.keys() == one_grads.keys()
        for name, grad in averaged.items():
            torch.testing.assert_close(grad, one_grads[name], rtol=1e-5, atol=1e-7)
    (dropped, _, first), (_, local, second) = (r["with_missing"] for r in results)
    assert dropped not in local  # rank 1 had none
    assert first.keys() == second.keys() == averaged.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name  # the replicas agree
    torch.testing.assert_close(second[dropped], results[0]["with_missing"][1][dropped] / 2)
