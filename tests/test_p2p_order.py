"""Torch's pipeline schedules post their sends and receives in an order NCCL can run: no
deadlock and no mismatched pair under strict rendezvous, for every schedule this project
runs, K 2-8, v = 2 for the multi-chunk ones, M up to 16, a training step and an
evaluation (tests/p2p_order.py records each rank's posts and waits from torch's own
`_step_microbatches`, and replays them). On gloo, sends are buffered and a bad order can
pass every CPU test and hang the first GPU run; a torch release that reorders them fails
here. Pure: no processes, about 3 s on 2 cores."""

from __future__ import annotations

import pytest
from p2p_order import Group, Op, Tensor, record_programs, simulate
from torch.distributed.pipelining import schedules as torch_schedules

from pipetransformer.config import SCHEDULE_PROPERTIES, SCHEDULES, micro_batch_problem

pytestmark = pytest.mark.gpu_rules


def layouts(schedule: str):
    """(K, v, M) for K 2-8, M up to 16 that the schedule runs (config/schedules.py)."""
    v = 2 if SCHEDULE_PROPERTIES[schedule].multi_chunk else 1
    for k in range(2, 9):
        for m in range(1, 17):
            if micro_batch_problem(schedule, k, m) is None:
                yield k, v, m


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_torchs_send_and_receive_order_never_deadlocks_or_mismatches(schedule):
    """Both FIFO models (one per rank pair, as NCCL's point-to-point communicators; one per
    rank, stricter), each boundary's activation and gradient sent once per micro-batch."""
    checked = 0
    for k, v, m in layouts(schedule):
        boundaries = k * v - 1  # the looped placement: every chunk boundary crosses ranks
        for training, programs in record_programs(schedule, k, v, m).items():
            for fifo in ("pair", "rank"):
                outcome = simulate(programs, fifo)
                where = (schedule, k, v, m, "training" if training else "evaluation", fifo)
                assert not outcome.deadlock, (where, outcome.stuck)
                assert outcome.mismatches == [], (where, outcome.mismatches)
                # a send and a receive per boundary, micro-batch and direction
                assert outcome.ops == 2 * boundaries * m * (2 if training else 1), where
                checked += 1
    assert checked >= 4 * 7  # every K, training and evaluation, both models


def test_the_simulator_sees_a_deadlock_torchs_fused_batches_avoid(monkeypatch):
    """Its own check: 1F1B fuses a forward send with a backward receive into one
    `batch_isend_irecv` (one NCCL group). Posted one by one instead, neighbours both send
    first and wait for each other under strict rendezvous: a deadlock, reported with what
    each rank waits for."""
    fused = torch_schedules._batch_p2p

    def one_by_one(ops, desc=None):
        return [work for op in ops for work in fused([op], desc)]

    monkeypatch.setattr(torch_schedules, "_batch_p2p", one_by_one)
    outcome = simulate(record_programs("1f1b", 2, 1, 4)[True], "pair")
    assert outcome.deadlock
    assert set(outcome.stuck) == {0, 1}
    assert "send of Tensor(kind='F'" in outcome.stuck[0]
    assert "send of Tensor(kind='B'" in outcome.stuck[1]


def test_the_simulator_reports_a_receive_of_the_wrong_micro_batch():
    first, second = Tensor("F", 0, 0), Tensor("F", 0, 1)
    sends = [Op(True, 0, 1, first), Op(True, 0, 1, second)]
    receives = [Op(False, 1, 0, second), Op(False, 1, 0, first)]  # posted the other way round
    programs = {
        0: [("post", Group([op])) for op in sends] + [("wait", op) for op in sends],
        1: [("post", Group([op])) for op in receives] + [("wait", op) for op in receives],
    }
    outcome = simulate(programs)
    assert not outcome.deadlock and len(outcome.mismatches) == 2
