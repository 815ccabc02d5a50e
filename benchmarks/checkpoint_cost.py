"""What checkpoints cost: the same run with a checkpoint after every epoch and with none,
side by side; then the checkpointed run resumed from its last checkpoint (nothing left to
train: what remains is loading). Prints the write time and size of each checkpoint, the
load time, and the training time per epoch with and without. Run from the repository root:

    python benchmarks/checkpoint_cost.py configs/quickstart.yaml
    python benchmarks/checkpoint_cost.py configs/bert_sst2_local.yaml \\
        model.model_name_or_path=$MINILM "model.kwargs={}" data.max_seq_length=64 \\
        data.train_subset=2000 trainer.global_batch_size=32 trainer.epochs=2 \\
        pipeline.initial_pipe_len=auto freeze.warmup_epochs=0 freeze.memory_aware=false \\
        freeze.eq1_bound=true autopipe.compression=params

(the MiniLM's freeze rule pinned to the Eq. 1 its record ran: the config's pretrained
default is since the late memory-aware rule, which freezes nothing where the model fits.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
from pathlib import Path

from harness import machine_line, train_command

from pipetransformer.runs.records import RunSummary
from pipetransformer.utils.files import read_jsonl


def train(config: str, overrides: list[str], run_dir: Path, resume: bool = False) -> None:
    command = train_command(config, overrides, run_dir, resume=resume)
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        with_ckpt, without = Path(tmp) / "with", Path(tmp) / "without"
        train(args.config, [*args.overrides, "checkpoint.interval_epochs=1"], with_ckpt)
        train(args.config, [*args.overrides, "checkpoint.interval_epochs=0"], without)
        train(
            args.config,
            [*args.overrides, "checkpoint.interval_epochs=1"],
            with_ckpt,
            resume=True,
        )
        writes = [e for e in read_jsonl(with_ckpt / "events.jsonl") if e["kind"] == "checkpoint"]
        (resume,) = [e for e in read_jsonl(with_ckpt / "events.jsonl") if e["kind"] == "resume"]
        epochs = {
            name: [m["epoch_time_s"] for m in read_jsonl(path / "metrics.jsonl")]
            for name, path in (("with", with_ckpt), ("without", without))
        }
        walls = {
            name: RunSummary.from_dict(
                json.loads((path / "summary.json").read_text())
            ).training_time_s
            for name, path in (("with", with_ckpt), ("without", without))
        }
    print(f"{machine_line()}; {args.config} {' '.join(args.overrides)}")
    print(
        f"checkpoint writes: {len(writes)}, "
        f"{statistics.median(e['write_s'] for e in writes):.3f} s median "
        f"(max {max(e['write_s'] for e in writes):.3f} s), "
        f"{writes[-1]['bytes'] / 2**20:.1f} MiB each"
    )
    print(f"load (resume from the last one): {resume['load_s']:.3f} s")
    print(
        f"training time per epoch: {statistics.mean(epochs['with']):.3f} s with checkpoints, "
        f"{statistics.mean(epochs['without']):.3f} s without; "
        f"wall time {walls['with']:.1f} s vs {walls['without']:.1f} s "
        f"(of which checkpoint writes {sum(e['write_s'] for e in writes):.2f} s)"
    )


if __name__ == "__main__":
    main()
