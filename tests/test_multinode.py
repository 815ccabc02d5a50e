"""Two nodes on one machine, through torchrun: launch/run_multi_node.sh started twice on the
loopback interface (c10d rendezvous, 2 processes each), a tiny model whose pipelines (one
of 2 stages per node) compress to 1 stage, so the replicas go from 2 to 4 and the data
groups span both nodes. Checked: every training sample once per epoch across the nodes,
one AutoCache daemon per node and cache hits on every rank after the transition (the new
replicas included), data groups across nodes, losses equal to single-process training
(the elastic tests' tolerance), one run directory."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from reference import elastic_config, reference_run

from pipetransformer.config import config_from_dict

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_two_torchrun_nodes_on_loopback(tmp_path):
    config_dict = elastic_config(
        trainer__nproc_per_node=2,
        pipeline__initial_pipe_len=2,
        trainer__record_sample_ids=True,
        cache__enabled=True,
        cache__profile=False,
    )
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
        "NPROC_PER_NODE": "2",
        "RDZV_ID": f"test-{os.getpid()}",
        "OMP_NUM_THREADS": "1",
    }
    script = str(ROOT / "launch" / "run_multi_node.sh")
    nodes = [
        subprocess.Popen(
            ["bash", script, str(config_path), "--run-dir", str(run_dir)],
            cwd=ROOT,
            env={**env, "NODE_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [node.communicate(timeout=600) for node in nodes]
    for node, (_, stderr) in zip(nodes, outputs):
        assert node.returncode == 0, stderr[-4000:]

    config = config_from_dict(config_dict)
    metrics = records(run_dir / "metrics.jsonl")
    assert [(m["pipe_len"], m["dp_degree"]) for m in metrics] == [(2, 2), (1, 4), (1, 4)]
    # Every sample once per epoch, across the nodes (each node keeps its own subset).
    seen = [r for path in sorted((run_dir / "samples").glob("rank*.jsonl")) for r in records(path)]
    for epoch in (1, 2, 3):
        ids = [i for r in seen if r["epoch"] == epoch for i in r["ids"]]
        assert sorted(ids) == list(range(config.data.train_subset)), f"epoch {epoch}"
    assert {r["node"] for r in seen} == {0, 1}
    events = records(run_dir / "events.jsonl")
    (start,) = [e for e in events if e["kind"] == "start"]
    assert sorted(d["node"] for d in start["cache_daemons"]) == [0, 1]
    assert len({d["daemon_pid"] for d in start["cache_daemons"]}) == 2
    compressing = [e for e in events if e["kind"] == "transition" and e["new_pipe_len"] == 1]
    assert compressing and compressing[0]["data_groups"] == [[0, 1, 2, 3]]  # ranks of both nodes
    # After the transition every rank is a first stage and reads the frozen prefix from its
    # node's cache: the replicas created by the transition (ranks 1 and 3) included.
    assert all(h > 0 for h in metrics[-1]["cache_hits_by_rank"])
    losses = [r["loss"] for r in records(run_dir / "steps.jsonl")]
    ref_losses, _, _ = reference_run(config, num_nodes=2)
    assert losses == pytest.approx(ref_losses, abs=1e-5)
    # One run directory for both nodes (profiles/ beside it is the shared measurement file).
    assert [p for p in tmp_path.iterdir() if (p / "metrics.jsonl").exists()] == [run_dir]
    assert len({Path(e["path"]).parent for e in events if e["kind"] == "checkpoint"}) == 1
