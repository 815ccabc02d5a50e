"""Reading a run's local data files once before any worker starts, to find bad contents
(a truncated TSV, malformed JSON, a missing column, an empty text, an unknown label) while
they can still be one line and exit code 2.

Parsing is cheap next to training (the 67k-sentence SST-2 training file reads in well under
a second); tokenising (and decoding images) is left to the workers. Owns: that check, and
writing the task and label names a data.name 'hf' or 'hf_image' table was found to have
into the config (so the run keeps them). Must not: keep what it read.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from pipetransformer.config import ConfigError, DataConfig


def validate_data_files(config: DataConfig) -> DataConfig:
    """`config`, with data.task and data.labels filled in for a data.name 'hf' or 'hf_image'
    table; raise ConfigError naming the file and the line, row or entry at fault."""
    try:
        if config.name == "sst2" and config.root is not None:
            from pipetransformer.data.text import read_sst2_tsv

            for split in ("train", "dev"):
                read_sst2_tsv(Path(config.root).expanduser() / f"{split}.tsv")
        elif config.name in ("hf", "hf_image"):
            from pipetransformer.data.table import read_tables

            tables = read_tables(config)
            task = tables.task if config.name == "hf" else config.task  # images: classes
            return dataclasses.replace(config, task=task, labels=tables.label_names or None)
        elif config.name == "squad":
            from pipetransformer.data.squad import load_squad_examples, read_squad_file

            if config.root is not None:
                load_squad_examples(config.root, config.eval_root)
            elif config.eval_root is not None:  # training data from `datasets`: fetched, not local
                read_squad_file(config.eval_root, key="data.eval_root")
    except (ValueError, FileNotFoundError) as exc:
        raise ConfigError(str(exc)) from None
    return config
