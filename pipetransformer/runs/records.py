"""The records a run writes, as types shared by their writer (the trainer) and their readers
(`compare`, resume, export, tests): one line of metrics.jsonl per epoch, of evaluations.jsonl
per evaluation, of steps.jsonl per logged step, and of events.jsonl per event (transition,
profiling, checkpoint, resume, start); summary.json at the end; and the values that make up
an epoch's line (evaluation results, cache counters).

**Clocks.** `training_time_s` (summary.json, and an evaluation's time into the run) is the
training loop's seconds with evaluation and checkpoint writes off the clock, every attempt
added (work a crash lost included); `eval_time_s` and `checkpoint_time_s` are beside it.

**Formats.** summary.json carries `format_version` (`SUMMARY_FORMAT` for what this release
writes); readers of older runs branch on it, never on which release wrote them:
1. the training clock is called `wall_time_s`, and counts evaluation and checkpoint writes;
2. it is `training_time_s`, and still counts them;
3. and `freeze_decided_by` says which term set each decision (empty before);
4. evaluation and checkpoint writes are off the clock (`eval_time_s`, `checkpoint_time_s`
   beside it), and evaluations.jsonl holds every evaluation (before: an epoch's end only,
   in metrics.jsonl).
A summary without the field is one of 1-3, told apart by the keys it has
(`RunSummary.from_dict`).

Epochs are counted as each file has always counted them: a line of metrics.jsonl or
steps.jsonl names its epoch 1-based (`epoch`), an event the 0-based epoch it happened in,
a checkpoint the epochs completed before it. All of them come from the trainer's one clock
(trainer/clock.py).

Each record is a dataclass; `to_dict` is what goes on disk, `from_dict` reads it back
(fields a record of an older run lacks take their defaults, unknown keys are ignored), so
no reader picks values out of loose dicts by key.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

T = TypeVar("T", bound="Record")


@dataclass
class Record:
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls: type[T], data: dict[str, Any]) -> T:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class EvalResult(Record):
    """One evaluation of the whole eval set, the same on every rank."""

    eval_metric: float  # data.metric (accuracy by default), or F1 for question answering
    eval_samples: int
    eval_loss: float | None = None
    exact_match: float | None = None  # question answering
    # Classification: accuracy, f1 (two classes), f1_macro and mcc; regression: pearson,
    # spearman and mse.
    scores: dict[str, float] | None = None


@dataclass
class CacheCounters(Record):
    """AutoCache over one epoch, summed over every rank."""

    cache_hits: int = 0
    cache_misses: int = 0
    cache_upgrades: int = 0
    cache_bytes_in_memory: int = 0
    cache_bytes_on_disk: int = 0
    cache_read_mb_per_s: float = 0.0
    cache_hits_by_rank: list[int] = field(default_factory=list)


SUMMARY_FORMAT = 4  # the module docstring's "Formats"
EVALUATIONS_FORMAT = 4  # from it on: evaluations.jsonl, and evaluation off the clock


def summary_format(data: dict[str, Any]) -> int:
    """The format of a summary.json's contents: its `format_version`, or for a summary
    written before the field, the format its keys show."""
    if "format_version" in data:
        return int(data["format_version"])
    if "training_time_s" not in data:
        return 1
    if data.get("eval_time_s") is not None:
        return EVALUATIONS_FORMAT
    return 3 if "freeze_decided_by" in data else 2


@dataclass
class RunSummary(Record):
    """summary.json: how a run ended (over all its attempts)."""

    # The training loop's seconds, all attempts added, evaluation and checkpoint writes off
    # the clock (set-up, worker start and the interpreter's start-up not included; in
    # formats 1-3 evaluation and checkpoints were on it).
    training_time_s: float
    attempts: int
    final_eval_metric: float | None
    best_eval_metric: float | None
    epochs: int
    global_steps: int
    num_transitions: int
    final_num_frozen_layers: int
    final_pipe_len: int
    final_dp_degree: int
    world_size: int
    device: str
    checkpoint: str | None
    metric_name: str = "eval_metric"  # what eval_metric measures (summaries of old runs lack it)
    # Classification and regression: every metric of the last evaluation (EvalResult.scores).
    final_scores: dict[str, float] | None = None
    freeze_decisions: int = 0  # decision points the freeze algorithm was asked at
    # Of them, how many each term set (freeze.py, "Who decided": signal, agree, bound, cap,
    # schedule, no_signal); empty in formats 1-2.
    freeze_decided_by: dict[str, int] = field(default_factory=dict)
    decision_interval_steps: int | None = None  # steps between them (None: epoch ends)
    num_layers: int = 0  # the model's layers (0: a summary of an older run)
    # The largest resident set of any process (interpreter and libraries included), and on
    # CUDA the largest torch.cuda.max_memory_allocated; None in older summaries.
    peak_rss_bytes: int | None = None
    peak_allocated_bytes: int | None = None
    freeze_strategy: str = ""  # freeze.strategy ("": a summary of an older run)
    # freeze.memory_aware in a layout no count of frozen layers changes (one stage, every
    # process a replica): the run took no decision (trainer/freezing.py `idle`).
    freeze_idle: bool = False
    # The seconds kept off training_time_s, all attempts added: every evaluation, and every
    # checkpoint write; None in formats 1-3 (their training_time_s counts both).
    eval_time_s: float | None = None
    checkpoint_time_s: float | None = None
    format_version: int = SUMMARY_FORMAT

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunSummary:
        found = summary_format(data)
        data = {**data, "format_version": found}
        if found == 1:
            data["training_time_s"] = data["wall_time_s"]
        return super().from_dict(data)

    @property
    def evaluation_on_the_clock(self) -> bool:
        """Whether training_time_s counts evaluation and checkpoint writes (formats 1-3)."""
        return self.format_version < EVALUATIONS_FORMAT

    def closing_line(self, run_dir: str, total_s: float | None = None) -> str:
        """One line for a person: how long, on two named clocks the same for a fresh and a
        resumed run (training: the training loop's seconds over every attempt, as
        summary.json's training_time_s; `total_s`: this command's whole time, start-up
        included), how well, how far it froze (and why not at all, when it froze nothing),
        where it ended and where its outputs are."""

        def duration(seconds_total: float) -> str:
            if seconds_total < 9.95:  # a short run's seconds are not 0 s
                return f"{seconds_total:.1f} s"
            minutes, seconds = divmod(round(seconds_total), 60)
            return f"{minutes} min {seconds:02d} s" if minutes else f"{seconds} s"

        took = f"training {duration(self.training_time_s)}"
        if self.attempts > 1:
            took += f" over {self.attempts} attempts"
        if total_s is not None:
            took += f", this command {duration(total_s)}"

        def score(value: float | None, name: str = self.metric_name) -> str:
            if value is None:
                return "-"
            return f"{100 * value:.2f}%" if name == "accuracy" else f"{value:.4f}"

        others = [
            f"{name} {score(value, name)}"
            for name, value in (self.final_scores or {}).items()
            if name != self.metric_name
        ]
        also = f" ({', '.join(others)})" if others else ""
        layers = f" of {self.num_layers}" if self.num_layers else ""
        why = f" ({self.why_nothing_froze()})" if self.final_num_frozen_layers == 0 else ""
        return (
            f"done: {took}: {self.metric_name} {score(self.final_eval_metric)} "
            f"final{also}, {score(self.best_eval_metric)} best; "
            f"{self.final_num_frozen_layers}{layers} layers frozen{why}; "
            f"pipe_len {self.final_pipe_len} x dp_degree {self.final_dp_degree}; "
            f"outputs in {run_dir}/ (metrics.jsonl, summary.json, checkpoints/"
            f"{', export/' if Path(run_dir, 'export').is_dir() else ''})"
        )

    def why_nothing_froze(self) -> str:
        """For a run that froze no layer: its rule, the decisions it made, and what held
        each at zero (freeze.py, "Who decided"), from the counts in this summary."""
        strategy = self.freeze_strategy or "the freeze rule"
        if self.freeze_strategy == "none":
            return "freeze.strategy none: nothing freezes"
        if self.freeze_idle:
            return (
                "freeze.memory_aware: no count of frozen layers changes a layout of one stage "
                "with every process a replica, so no decision was taken"
            )
        if self.freeze_decisions == 0:
            return (
                f"{strategy}: no decision point in the run, where freeze.warmup_epochs and "
                "freeze.interval_steps place them"
            )
        held = [
            f"{HELD_BY.get(by, by)} {count}"
            for by, count in sorted(self.freeze_decided_by.items(), key=lambda kv: -kv[1])
        ]
        signal = SIGNAL_HELD.get(self.freeze_strategy)
        detail = f"; {signal}" if signal and "signal" in self.freeze_decided_by else ""
        decisions = f"{self.freeze_decisions} decision{'s' if self.freeze_decisions > 1 else ''}"
        return f"{strategy}: {decisions}, none froze a layer: {', '.join(held)}{detail}"


# What held a decision at zero frozen layers, by freeze.FreezeOutcome.decided_by.
HELD_BY = {
    "signal": "held by its signal",
    "agree": "signal and bound at zero",
    "bound": "held by Eq. 1's bound",
    "cap": "held by freeze.max_frozen_layers",
    "no_signal": "nothing to read yet",
    "schedule": "the schedule said zero",
}
# What a rule's signal saw when it held the bottom layer active.
SIGNAL_HELD = {
    "gradient_norm": "the smallest gradient norm was at layer 0, which Eq. 1 keeps active",
    "gradient_norm_inclusive": "the smallest gradient norm was at no layer it may freeze",
    "convergence": "layer 0's gradient norms still changed by freeze.convergence_threshold",
    "signal_to_noise": "layer 0's signal share stayed above freeze.signal_threshold",
    "autofreeze": "layer 0's gradient changed by at least freeze.percentile of the others'",
}


@dataclass
class EpochMetrics(Record):
    """One line of metrics.jsonl: an epoch's training, evaluation and layout."""

    epoch: int  # 1-based
    global_step: int
    train_loss: float
    eval_metric: float | None
    samples_per_s: float
    epoch_time_s: float
    num_frozen_layers: int
    pipe_len: int
    dp_degree: int
    num_micro_batches: int
    lr: float = 0.0
    eval_loss: float | None = None
    eval_samples: int | None = None
    exact_match: float | None = None  # question answering
    # Classification and regression: every metric of the evaluation (EvalResult.scores).
    scores: dict[str, float] | None = None
    eval_time_s: float = 0.0  # every evaluation of the epoch (one, at its end, by default)
    transition_time_s: float = 0.0
    ddp_comm_s: float = 0.0
    ddp_comm_share: float = 0.0
    cache_active: bool = False
    cache_hits: int = 0
    cache_misses: int = 0
    cache_upgrades: int = 0
    cache_bytes_in_memory: int = 0
    cache_bytes_on_disk: int = 0
    cache_read_mb_per_s: float = 0.0
    cache_hits_by_rank: list[int] = field(default_factory=list)
    sharded: bool = False  # FSDP2 over the replicas (a sharded layout, fsdp/)
    virtual_stages: int = 1  # chunks a stage (interleaved_1f1b, zero_bubble)
    # Text: the epoch's real tokens (every training sample's, before padding) and the tokens
    # its batches held once padded (what was computed, shape padding included); 0 for
    # images and in older records. Real tokens per second: real_tokens / epoch_time_s.
    real_tokens: int = 0
    padded_tokens: int = 0


@dataclass
class Evaluation(Record):
    """One line of evaluations.jsonl: an evaluation of the whole eval set, where the run was
    (`trainer.evals_per_epoch` of them an epoch, at the same shares of it in every run) and
    how much training it had had. Time-to-target reads these (compare/target.py)."""

    global_step: int
    epoch: int  # 1-based epoch it was taken in
    # Epochs of training before it: 0.25 after a quarter of the first epoch's samples.
    epochs_done: float
    samples: int  # training samples before it (epochs_done x the training set)
    # Training seconds before it: the clock of summary.json's training_time_s (evaluation
    # and checkpoint writes off it, every attempt added).
    training_time_s: float
    eval_time_s: float  # this evaluation's seconds
    eval_metric: float
    checkpoint_time_s: float = 0.0  # checkpoint writes before it, every attempt added
    eval_loss: float | None = None
    scores: dict[str, float] | None = None
    num_frozen_layers: int = 0
    pipe_len: int = 1
    dp_degree: int = 1


@dataclass
class StepMetrics(Record):
    """One line of steps.jsonl, every trainer.log_interval_steps steps."""

    global_step: int
    epoch: int  # 1-based
    loss: float  # mean per-sample loss over the steps since the previous line
    lr: float
    samples_per_s: float
    num_frozen_layers: int
    pipe_len: int
    dp_degree: int
    # optimizer.layerwise_anneal: each layer's learning rate at the logged step (0 once its
    # curve reached its freeze place; `lr` is the run's, which the head follows); None
    # without annealing.
    layer_lrs: list[float] | None = None


@dataclass
class Event(Record):
    kind: ClassVar[str] = ""

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **dataclasses.asdict(self)}


@dataclass
class TransitionEvent(Event):
    kind: ClassVar[str] = "transition"
    epoch: int  # 0-based epoch the transition happened in
    step: int  # steps of that epoch before it
    global_step: int
    old_num_frozen_layers: int
    new_num_frozen_layers: int
    old_pipe_len: int
    new_pipe_len: int
    old_dp_degree: int
    new_dp_degree: int
    new_stage_ranges: list[list[int]]  # per chunk (new_virtual_stages chunks a stage)
    num_micro_batches: int
    units_moved: int
    new_virtual_stages: int = 1  # chunks a stage under interleaved_1f1b and zero_bubble
    # Each rank's peak bytes while the units moved, by the memory model (MemoryModel.move_bytes).
    predicted_move_bytes: list[int] = field(default_factory=list)
    layer_grad_norms: list[float] | None = None
    data_groups: list[list[int]] = field(default_factory=list)  # ranks of each stage's replicas
    plan_s: float = 0.0
    state_move_s: float = 0.0
    release_s: float = 0.0  # of state_move_s: dropping the old runtime and optimizer
    groups_s: float = 0.0
    profile_s: float = 0.0
    # trainer.compile: compiling the new layout's graphs before its first step, the ranks
    # agreeing they are done (pipe/warmup.py)
    compile_s: float = 0.0
    rebuild_s: float = 0.0
    total_s: float = 0.0
    old_sharded: bool = False
    new_sharded: bool = False


@dataclass
class ProfileEvent(Event):
    kind: ClassVar[str] = "profile"
    global_step: int
    profile_s: float
    cost_source: str


@dataclass
class StartEvent(Event):
    """An attempt began: the first of a run, or a resume or restart."""

    kind: ClassVar[str] = "start"
    global_step: int
    attempt: int
    time: float  # unix time
    world_size: int
    pipe_len: int
    dp_degree: int
    num_frozen_layers: int
    virtual_stages: int = 1  # chunks a stage under interleaved_1f1b and zero_bubble
    # Processes per node and who set it: "torchrun" (its LOCAL_WORLD_SIZE overrules
    # trainer.nproc_per_node) or "local launcher" (trainer.nproc_per_node or --nproc).
    processes_per_node: int = 0
    processes_per_node_from: str = ""
    cache_daemons: list[dict[str, Any]] = field(default_factory=list)  # one per node
    # The memory model's peak bytes per stage of the starting layout, and the device budget
    # (None: unlimited); memory_source 'profile' (measured) or 'params' (no activations).
    predicted_stage_bytes: list[int] = field(default_factory=list)
    device_memory_bytes: float | None = None
    memory_source: str = "params"
    sharded: bool = False
    # Settings this run decides from times it measures (opt-in: 'measured'), which may
    # differ on a busier machine; empty: every decision follows from the config and seed.
    decided_by_measured_time: list[str] = field(default_factory=list)
    # optimizer.layerwise_anneal: per layer, the planned freeze place the attempt starts
    # with (as in freeze_decision events); None without annealing.
    planned_freeze_steps: list[float | None] | None = None
    # freeze.memory_aware: the counts of frozen layers that change the starting layout, to
    # which its decisions are held (empty: none does, so no layer will freeze and no
    # decision is taken); None without it.
    freeze_counts_that_pay: list[int] | None = None


@dataclass
class ResumeEvent(Event):
    kind: ClassVar[str] = "resume"
    global_step: int
    epoch: int  # 0-based epoch it continues
    step: int  # steps of that epoch already taken
    checkpoint: str
    attempt: int
    num_frozen_layers: int
    pipe_len: int
    dp_degree: int
    num_micro_batches: int
    world_size: int
    checkpoint_world_size: int
    rng: str  # "restored" or "reseeded" (the world size changed)
    load_s: float
    previous_attempt_wall_s: float


@dataclass
class CheckpointEvent(Event):
    kind: ClassVar[str] = "checkpoint"
    global_step: int
    epoch: int  # completed epochs at the checkpoint
    path: str
    reason: str  # "epoch", "steps" or the signal that stopped the run
    write_s: float
    bytes: int
    eval_metric: float | None = None


@dataclass
class CadenceEvent(Event):
    """freeze.interval_steps 'measured' measured the decision interval (at the first transition):
    a transition may take at most `time_share` of the time between two decisions."""

    kind: ClassVar[str] = "cadence"
    global_step: int
    interval_steps: int  # steps between decisions from here on
    default_interval_steps: int  # what 'auto' decides without a measurement
    transition_s: float  # the slowest rank's transition, without micro-batch profiling
    step_s: float  # the slowest rank's mean step in the interval before it
    time_share: float
    decisions_left: int  # decision points the rest of the run holds at this interval


@dataclass
class FreezeDecisionEvent(Event):
    """One decision point of the freeze algorithm, whatever it decided: the layer count
    before and after, the signal's own proposal, Eq. 1's bound and the cap, and which of
    them set the count (freeze.py, "Who decided")."""

    kind: ClassVar[str] = "freeze_decision"
    decision_index: int  # from 1
    epoch: int  # 0-based epoch the decision was taken in
    global_step: int
    old_num_frozen_layers: int
    new_num_frozen_layers: int
    proposed: int | None  # the signal's own proposal (None: the rule read no signal)
    bound: int | None  # Eq. 1's bound (None: the rule has none, or freeze.eq1_bound false)
    cap: int  # the most layers that may be frozen (freeze.max_frozen_layers, or L - 1)
    decided_by: str  # signal, agree, bound, cap, schedule, no_signal or plan
    layer_grad_norms: list[float] | None = None  # the per-layer norms it read, if any
    # optimizer.layerwise_anneal (None without it; pipetransformer/anneal.py): the count the
    # rule alone decided, the plan's count here (the frozen layers and those whose rate had
    # reached 0), and per layer the planned freeze place after this decision (the learning
    # rate schedule's steps: the global step under a fixed global batch; None: never).
    rule_num_frozen_layers: int | None = None
    planned_num_frozen_layers: int | None = None
    planned_freeze_steps: list[float | None] | None = None


@dataclass
class ConfigChangeEvent(Event):
    """A resume with settings that differ from the checkpoint's (e.g. more epochs)."""

    kind: ClassVar[str] = "config_change"
    global_step: int
    checkpoint: str
    changes: dict[str, list[Any]]  # dotted key -> [before, after]


EVENT_TYPES: dict[str, type[Event]] = {
    cls.kind: cls
    for cls in (
        TransitionEvent,
        FreezeDecisionEvent,
        ProfileEvent,
        StartEvent,
        ResumeEvent,
        CheckpointEvent,
        CadenceEvent,
        ConfigChangeEvent,
    )
}


def event_from_dict(data: dict[str, Any]) -> Event:
    kind = data.get("kind", "transition")  # the first runs wrote transitions without a kind
    if kind not in EVENT_TYPES:
        raise ValueError(f"unknown event kind {kind!r}")
    return EVENT_TYPES[kind].from_dict(data)
