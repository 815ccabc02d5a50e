"""The elastic tests' reference: a plain single-process loop over the same global batches,
freezing the same layers at the same points, and the config those tests share."""

import copy
import json
import math

import torch

from pipetransformer.data import build_data
from pipetransformer.models import build_model
from pipetransformer.trainer import optim
from pipetransformer.trainer.step import train_sampler
from pipetransformer.utils.units import prefix_end


def elastic_config(**changes):
    data = {
        "trainer": {
            "epochs": 3,
            "seed": 0,
            "global_batch_size": 32,
            "nproc_per_node": 4,
            "progress_bar": False,
            "log_interval_steps": 1,
        },
        "optimizer": {
            "name": "sgd",
            "lr": 0.05,
            "momentum": 0.9,
            "lr_schedule": "cosine",
            "warmup_steps": 2,
        },
        # The layouts these tests check are pipelines (tests/test_fsdp.py shards its own).
        "pipeline": {
            "initial_pipe_len": 4,
            "num_micro_batches": 2,
            "balance": "params",
            "sharding": "never",
        },
        "freeze": {
            "strategy": "manual",
            "manual_schedule": [3, 5],
            "interval_steps": None,
        },  # epoch ends
        "autopipe": {"lambda_frozen": 0.02},
        "model": {
            "name": "vit_tiny_patch16_224",
            "kwargs": {
                "patch_size": 4,
                "embed_dim": 32,
                "depth": 6,
                "num_heads": 2,
                "mlp_ratio": 2.0,
            },
        },
        "data": {"name": "digits", "image_size": 8, "train_subset": 200, "eval_subset": 64},
    }
    for key, value in changes.items():
        section, name = key.split("__")
        data.setdefault(section, {})[name] = value
    return data


def step_losses(run_dir) -> list[float]:
    """Each step's mean loss from steps.jsonl (written every step with log_interval_steps 1)."""
    records = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    assert [r["global_step"] for r in records] == list(range(1, len(records) + 1))
    return [r["loss"] for r in records]


# Sections and keys reference_run never reads: runs of configs that differ only there (the
# world, the layouts, checkpoints, the cache) share one reference, computed once a session.
_UNREAD = ("pipeline", "checkpoint", "cache", "autopipe", "autodp", "logging")
_UNREAD_TRAINER = ("nproc_per_node", "record_sample_ids", "log_interval_steps", "progress_bar")
_REFERENCES: dict[str, tuple] = {}


def reference_run(config, num_nodes: int = 1, replicas_per_node=None):
    """`_reference_run`, once per session for each config that differs where it reads
    (a copy each time: callers may change what they get)."""
    if replicas_per_node is not None:  # a function: no key
        return _reference_run(config, num_nodes, replicas_per_node)
    data = {k: v for k, v in config.to_dict().items() if k not in _UNREAD}
    data["trainer"] = {k: v for k, v in data["trainer"].items() if k not in _UNREAD_TRAINER}
    key = json.dumps([data, num_nodes], sort_keys=True, default=str)
    if key not in _REFERENCES:
        _REFERENCES[key] = _reference_run(config, num_nodes)
    return copy.deepcopy(_REFERENCES[key])


def _reference_run(config, num_nodes: int = 1, replicas_per_node=None):
    """Single process, whole model, same batches, same freeze points (a classification
    task: images or text, each global batch padded as data.padding pads a batch). With
    several nodes a global batch is every node's batch of the step (each node samples its
    own subset).

    Under trainer.batch_per_replica a step's batch is that of the layout's replicas:
    `replicas_per_node(epoch, step)` says how many a node had at each step (the layouts the
    elastic run went through). The learning rate follows the schedule as documented in
    trainer/clock.py: step s of epoch e sits at e x S + (samples before it) / B, B a node's
    batch at the first step and S = ceil(a node's epoch / B). With
    optimizer.layerwise_anneal each unit has a group of its own and its layer's rate
    (`annealed_rate`, written out here apart from the trainer's code)."""
    data = build_data(config.data, seed=config.trainer.seed)
    torch.manual_seed(config.trainer.seed)
    model = build_model(
        config.model,
        task=data.task,
        num_classes=data.num_classes,
        in_chans=data.in_chans,
        image_size=data.image_size,
        vocab_size=data.vocab_size,
        max_seq_length=data.max_seq_length,
    )
    named = {
        f"units.{i}.{n}": p for i, u in enumerate(model.units) for n, p in u.named_parameters()
    }
    embedding_frozen = config.embedding_frozen  # freeze.embedding: from the start
    if embedding_frozen:
        model.units[0].requires_grad_(False)
        model.units[0].eval()
    anneal = config.optimizer.layerwise_anneal
    if anneal:
        optimizer = unit_groups_optimizer(config.optimizer, model.units)
    else:
        optimizer = optim.build_optimizer(config.optimizer, named)
    # The trainer's sampler (its batch semantics, and data.group_by_length).
    sampler = train_sampler(config, data.train, num_nodes)

    def replicas(epoch: int, step: int) -> int:
        return 1 if replicas_per_node is None else replicas_per_node(epoch, step)

    reference = sampler.node_batch_size(replicas(0, 0))
    per_epoch = math.ceil(sampler.epoch_samples / reference)
    total = config.trainer.epochs * per_epoch
    losses = []
    for epoch in range(config.trainer.epochs):
        offset, step = 0, 0
        while offset < sampler.epoch_samples:
            sampler.continue_at(epoch, step, offset, replicas(epoch, step))
            batches = [sampler.node_batch(node, epoch, step) for node in range(num_nodes)]
            inputs, labels = data.train.fetch([i for b in batches for i in b.ids])
            valid = torch.tensor([v for b in batches for v in b.valid])
            per_sample = torch.nn.functional.cross_entropy(model(*inputs), labels, reduction="none")
            loss = (per_sample * valid).sum() / valid.sum()
            place = epoch * per_epoch + offset / reference
            if anneal:
                freeze_at = manual_freeze_places(config, len(model.units) // 2 - 1, per_epoch)
                for group in optimizer.param_groups:
                    layer = annealed_layer_of(group["unit"], len(model.units))
                    place_at = None if layer is None else freeze_at[layer]
                    group["lr"] = annealed_rate(config.optimizer, place, total, place_at)
            else:
                lr = optim.learning_rate(config.optimizer, place, total)
                optim.set_learning_rate(optimizer, lr)
            loss.backward()
            if config.optimizer.max_grad_norm is not None:
                trained = [p for p in model.parameters() if p.requires_grad]
                torch.nn.utils.clip_grad_norm_(trained, config.optimizer.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
            offset += len(batches[0].ids)
            step += 1
        if epoch + 1 < config.trainer.epochs:
            frozen = config.freeze.manual_schedule[
                min(epoch, len(config.freeze.manual_schedule) - 1)
            ]
            for unit in list(model.units)[: prefix_end(frozen, embedding_frozen)]:
                unit.requires_grad_(False)
                unit.eval()
    return losses, model.state_dict(), sampler


def unit_groups_optimizer(settings, units) -> torch.optim.Optimizer:
    """A group per unit (SGD, or AdamW without weight decay: what the anneal tests run)."""
    assert settings.weight_decay == 0
    groups = [{"params": list(unit.parameters()), "unit": i} for i, unit in enumerate(units)]
    if settings.name == "sgd":
        return torch.optim.SGD(groups, lr=settings.lr, momentum=settings.momentum)
    return torch.optim.AdamW(groups, lr=settings.lr, betas=tuple(settings.betas), eps=settings.eps)


def annealed_layer_of(unit: int, num_units: int):
    """The layer whose curve a unit follows: the embedding layer 0's, the head none."""
    if unit == num_units - 1:
        return None
    return 0 if unit == 0 else (unit - 1) // 2


def manual_freeze_places(config, num_layers: int, per_epoch: int) -> list:
    """Per layer, the place it freezes under a manual schedule decided at epoch ends."""
    places = [None] * num_layers
    schedule = config.freeze.manual_schedule
    for epoch in range(config.trainer.epochs - 1):
        frozen = min(schedule[min(epoch, len(schedule) - 1)], num_layers - 1)
        for layer in range(frozen):
            if places[layer] is None:
                places[layer] = (epoch + 1) * per_epoch
    return places


def annealed_rate(settings, place: float, total: int, freeze_at) -> float:
    """FreezeOut's rate for a layer that freezes at `freeze_at` (None: the run's schedule):
    the run's warm-up, then its cosine decay squeezed to reach 0 at `freeze_at`."""
    assert settings.lr_schedule == "cosine"
    warmup = settings.warmup_steps
    end = total if freeze_at is None else freeze_at
    floor = settings.lr * settings.min_lr_ratio if freeze_at is None else 0.0
    if place < warmup:
        return settings.lr * (place + 1) / warmup
    if place >= end:
        return floor
    progress = (place - warmup) / (end - warmup)
    return floor + (settings.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))
