"""Unit-space arithmetic shared by models and planners.

A model is a list of units: 0 = embedding, 1 + 2l = layer l's attention sublayer,
2 + 2l = layer l's MLP sublayer, 2L + 1 = head. With F layers frozen, the frozen prefix
is units [0, prefix_end(F)).
"""

from __future__ import annotations


def num_units(num_layers: int) -> int:
    return 2 * num_layers + 2


def attention_unit(layer: int) -> int:
    return 1 + 2 * layer


def mlp_unit(layer: int) -> int:
    return 2 + 2 * layer


def prefix_end(num_frozen_layers: int, frozen_embedding: bool = False) -> int:
    """First unit after the frozen prefix: the embedding freezes with the first layer, or
    from the start with `frozen_embedding` (`freeze.embedding`)."""
    if num_frozen_layers == 0:
        return 1 if frozen_embedding else 0
    return 1 + 2 * num_frozen_layers


def layer_of_unit(unit: int, num_layers: int) -> int | None:
    """The layer a unit belongs to; None for the embedding and the head."""
    if unit == 0 or unit == 2 * num_layers + 1:
        return None
    return (unit - 1) // 2


def param_key(unit: int, name: str) -> str:
    """The global name of a unit's parameter, buffer or optimizer state entry:
    'units.<unit>.<name>', the key LayeredModel.state_dict() uses. Stable across ranks,
    layouts and world sizes: handoffs, optimizer state and checkpoints all key by it."""
    return f"units.{unit}.{name}"


def parse_param_key(key: str) -> tuple[int, str]:
    """(unit, name) of a `param_key`; ValueError for anything else."""
    prefix, _, rest = key.partition(".")
    index, _, name = rest.partition(".")
    if prefix != "units" or not index.isdigit() or not name:
        raise ValueError(f"not a parameter key: {key!r} (expected 'units.<unit>.<name>')")
    return int(index), name
