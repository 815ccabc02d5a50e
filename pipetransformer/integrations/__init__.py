"""Elastic freeze training inside other trainers' scripts (docs/integrations.md):

- `pipetransformer.integrations.transformers.FreezeCallback`, a transformers
  `TrainerCallback`;
- `pipetransformer.integrations.lightning.FreezeFinetuning`, a Lightning `BaseFinetuning`
  (the `.[lightning]` extra).

Both take the config's `freeze:` keys, reuse the trainer's rules (freeze.py), its decision
driver and per-layer gradient-norm bookkeeping (freeze_signal.py) and the model adapters
(models/), and own only the glue to their trainer: where the layer stack is, when a
decision point falls, and how the trainer's DDP wrapper stops synchronising the frozen
prefix without `find_unused_parameters` (ddp.py).

Must not: import transformers or Lightning here (each module imports its own library), or
the trainer (trainer/ and integrations/ are siblings).
"""
