"""Two nodes on one machine, through torchrun: launch/run_multi_node.sh started twice on the
loopback interface (c10d rendezvous), a tiny model whose pipelines compress as layers
freeze, so the replicas multiply and the data groups span both nodes:
- 2 x 2 processes: one 2-stage pipeline per node -> 1 stage x 4 replicas;
- 2 x 8 processes, the paper's shape: 8-stage pipelines -> 4 -> 2 stages x 8 replicas, with a
  config that says 2 processes per node (torchrun's 8 overrule it, with one warning);
- 2 x 2 with one worker SIGKILLed after the first transition (torchrun --max-restarts 1
  restarts both nodes' workers, which resume from the latest checkpoint): an open defect,
  not run by default (the restarted gloo group hangs in about half the runs).
Checked: every training sample once per epoch across the nodes in every layout, one
AutoCache daemon per node and cache hits on every rank after compression (the new replicas
included), data groups across nodes, losses equal to single-process training (the elastic
tests' tolerance), one run directory."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from reference import elastic_config, reference_run

from pipetransformer.config import config_from_dict
from pipetransformer.runs.checkpoint import find_checkpoint

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2 :].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def torchrun_workers(script_pid: int) -> list[int]:
    """The trainer processes under a node's torchrun agent (the script execs torchrun)."""
    return [
        pid
        for pid in children(script_pid)
        if b"pipetransformer" in Path(f"/proc/{pid}/cmdline").read_bytes()
        and b"autocache" not in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]


def kill_one_worker_after(run_dir: Path, step: int, agent_pid: int, timeout_s: float) -> None:
    """SIGKILL one trainer of a node once the run has a complete checkpoint at `step`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready = (run_dir / "checkpoints").is_dir() and find_checkpoint(run_dir) is not None
        if ready and int(find_checkpoint(run_dir).name.split("-")[1]) >= step:
            os.kill(torchrun_workers(agent_pid)[-1], signal.SIGKILL)
            return
        time.sleep(0.2)
    raise AssertionError(f"no checkpoint at step {step} in {timeout_s} s")


@pytest.mark.slow
@pytest.mark.parametrize(
    "nproc, schedule, layouts, kill_after_step",
    [
        # Two stages pack into one only once the active half is no larger than the initial
        # plan's largest stage in parameter size (Eq. 2): at 4 of 6 layers, not 3.
        (2, [4, 5], [(2, 2), (1, 4), (1, 4)], None),
        (2, [4, 5], [(2, 2), (1, 4), (1, 4)], 8),
        # 16 ranks, one SIGKILLed after step 8 (past the first transition). The last layout
        # twice: its second epoch reads the cache it filled in the first.
        (8, [3, 5], [(8, 2), (4, 4), (2, 8), (2, 8)], 8),
    ],
    ids=["2x2", "2x2-killed", "2x8-killed"],
)
def test_two_torchrun_nodes_on_loopback(tmp_path, nproc, schedule, layouts, kill_after_step):
    """Costs ~25 s (2 x 2), 35-100 s (2 x 2 with a restart: 100 s when a node's agent waits
    out its workers' 30 s SIGTERM grace) and ~145 s (2 x 8 with a restart) on 2 cores."""
    config_dict = elastic_config(
        trainer__nproc_per_node=2,
        trainer__epochs=len(layouts),
        pipeline__initial_pipe_len=nproc,
        freeze__manual_schedule=schedule,
        trainer__record_sample_ids=True,
        cache__enabled=True,
        cache__profile=False,
        checkpoint__interval_steps=5,
        checkpoint__keep_last=20,
    )
    # The 2 x 8 config still says 2 processes per node (initial_pipe_len 8 does not divide
    # 2): torchrun's count is taken.
    trainer = config_dict["trainer"]
    config_path = tmp_path / "two_nodes.yaml"
    config_path.write_text(yaml.safe_dump(config_dict))
    run_dir = tmp_path / "run"
    # The script runs `torchrun`: this interpreter's, also when its environment is not activated.
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    env = {
        **os.environ,
        "PATH": path,
        "NNODES": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "NPROC_PER_NODE": str(nproc),
        "MAX_RESTARTS": "1" if kill_after_step else "0",
        "RDZV_ID": f"test-{os.getpid()}-{nproc}",
        "OMP_NUM_THREADS": "1",
    }
    script = str(ROOT / "launch" / "run_multi_node.sh")
    logs = [tmp_path / f"node{rank}.log" for rank in range(2)]
    nodes = [
        subprocess.Popen(
            ["bash", script, str(config_path), "--run-dir", str(run_dir)],
            cwd=ROOT,
            env={**env, "NODE_RANK": str(rank)},
            stdout=subprocess.DEVNULL,
            stderr=log.open("w"),
        )
        for rank, log in enumerate(logs)
    ]
    if kill_after_step is not None:
        kill_one_worker_after(run_dir, kill_after_step, nodes[1].pid, timeout_s=480)
    for node in nodes:
        node.wait(timeout=900)
    outputs = [("", log.read_text()) for log in logs]
    for node, (_, stderr) in zip(nodes, outputs):
        assert node.returncode == 0, stderr[-4000:]
    warnings = [
        line for _, err in outputs for line in err.splitlines() if "torchrun started" in line
    ]
    assert len(warnings) == (1 if nproc != 2 else 0) * (2 if kill_after_step else 1)

    # Single-process reference: the same run as torchrun made it (nproc processes a node).
    config = config_from_dict({**config_dict, "trainer": {**trainer, "nproc_per_node": nproc}})
    metrics = records(run_dir / "metrics.jsonl")
    assert [(m["pipe_len"], m["dp_degree"]) for m in metrics] == layouts
    # Every sample once per epoch, across the nodes (each node keeps its own subset); an
    # epoch cut by the kill counts from its resumed attempt on.
    seen = [r for path in sorted((run_dir / "samples").glob("rank*.jsonl")) for r in records(path)]
    for epoch in range(1, len(layouts) + 1):
        ids = [i for r in seen if r["epoch"] == epoch for i in r["ids"]]
        assert sorted(ids) == list(range(config.data.train_subset)), f"epoch {epoch}"
    assert {r["node"] for r in seen} == {0, 1}
    events = records(run_dir / "events.jsonl")
    starts = [e for e in events if e["kind"] == "start"]
    assert len(starts) == (2 if kill_after_step else 1)
    for start in starts:
        assert (start["processes_per_node"], start["processes_per_node_from"]) == (
            nproc,
            "torchrun",
        )
        assert sorted(d["node"] for d in start["cache_daemons"]) == [0, 1]
        assert len({d["daemon_pid"] for d in start["cache_daemons"]}) == 2
    if kill_after_step:
        (resume,) = [e for e in events if e["kind"] == "resume"]
        assert resume["global_step"] >= kill_after_step and resume["num_frozen_layers"] >= 3
    compressing = [e for e in events if e["kind"] == "transition" and e["new_pipe_len"] < nproc]
    final = compressing[-1]  # one data group per stage, each of every replica: both nodes
    assert len(final["data_groups"]) == final["new_pipe_len"]
    for group in final["data_groups"]:
        assert len(group) == layouts[-1][1] and {rank // nproc for rank in group} == {0, 1}
    # After compression every first stage reads the frozen prefix from its node's cache: the
    # replicas created by the transitions included.
    first_stages = [h for h in metrics[-1]["cache_hits_by_rank"] if h > 0]
    assert len(first_stages) == layouts[-1][1]
    losses = [r["loss"] for r in records(run_dir / "steps.jsonl")]
    ref_losses, _, _ = reference_run(config, num_nodes=2)
    assert losses == pytest.approx(ref_losses, abs=1e-5)
    # One run directory for both nodes (profiles/ beside it is the shared measurement file).
    assert [p for p in tmp_path.iterdir() if (p / "metrics.jsonl").exists()] == [run_dir]
    assert len({Path(e["path"]).parent for e in events if e["kind"] == "checkpoint"}) == 1
