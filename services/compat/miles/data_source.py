"""Miles' `miles.rollout.data_source`: DataSource, RolloutDataSource(WithBuffer), pop_first.

What --data-source-path names: a class built with `args` whose `get_samples(n)` returns n
groups, each a list of n_samples_per_prompt `Sample`s of one prompt. The trainer builds it once
and reads each group's first Sample for the prompt, its label and metadata (trainer/data.py
PluginDataSource says how); `save(rollout_id)` runs with every checkpoint and
`load(rollout_id)` on resume. `add_samples`, Miles' way back for the groups an abort left
unfinished, is never called here: those groups stay in the rollout workers' partial buffer
(--buffer-filter-path orders it), so it is not abstract here.

`RolloutDataSource(args)` is Miles' default: the rows of --prompt-data read with Miles' own
flags (`input_key`, `label_key`, `metadata_key`, `tool_key`, `apply_chat_template`,
`rollout_max_prompt_len`, `rollout_shuffle`, `rollout_seed`; utils/data.py `Dataset`), taken
in order across epochs, a fresh permutation each epoch with --rollout-shuffle, each prompt
copied n_samples_per_prompt times with Miles' numbering (`group_index` per prompt, `index`
per sample, counting on across calls). Its position (offset, epoch, counters) is saved as
JSON at `{save}/rollout/global_dataset_state_dict_{rollout_id}.json` (Miles writes the same
dict with torch.save to a `.pt`) and read back from `{load}` (`{save}` when no --load is
given: a resumed run reads where it wrote). `RolloutDataSourceWithBuffer` puts Miles' buffer
in front: groups given to `add_samples` come out first, in the order --buffer-filter-path
picks (`pop_first` without one).

Flags Miles has and millstream's config lacks are read with Miles' defaults:
`rollout_global_dataset` (True), `chat_template_path`, `multimodal_keys`,
`apply_chat_template_kwargs`, `dump_details` (None).
"""

from __future__ import annotations

import abc
import copy
import json
import logging
import os
from pathlib import Path
from typing import Any

from .data import Dataset
from .misc import load_function
from .processing_utils import load_processor, load_tokenizer
from .types import Sample

__all__ = ["DataSource", "RolloutDataSource", "RolloutDataSourceWithBuffer", "pop_first"]

log = logging.getLogger(__name__)


class DataSource(abc.ABC):
    """What --data-source-path names (see the module docstring)."""

    @abc.abstractmethod
    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        """The next num_samples groups."""

    def add_samples(self, samples: list[list[Sample]]) -> None:
        """Take groups back for a later rollout (Miles'; never called here)."""
        raise NotImplementedError(f"{type(self).__name__} takes no samples back")

    @abc.abstractmethod
    def save(self, rollout_id: int) -> None:
        """Keep the position in the data, for a resume at rollout_id."""

    @abc.abstractmethod
    def load(self, rollout_id: int | None = None) -> None:
        """Go back to the position saved at rollout_id."""

    def get_buffer_length(self) -> int | None:
        """Groups waiting in a buffer, or None for a source without one."""
        return None


def _model_path(args: Any) -> str:
    path = getattr(args, "hf_checkpoint", None) or getattr(args, "ref_load", None)
    if not path:
        raise ValueError("RolloutDataSource needs --hf-checkpoint for its tokenizer")
    return path


class RolloutDataSource(DataSource):
    """Miles' default data source over --prompt-data (see the module docstring)."""

    def __init__(self, args: Any):
        self.args = args
        self.epoch_id = 0
        self.sample_group_index = 0
        self.sample_index = 0
        self.sample_offset = 0
        self.metadata: dict[str, Any] = {}
        self.dataset: Dataset | None = None
        if not getattr(args, "rollout_global_dataset", True):
            return
        path = _model_path(args)
        tokenizer = load_tokenizer(
            path, chat_template_path=getattr(args, "chat_template_path", None)
        )
        processor = load_processor(path)
        if (dump := getattr(args, "dump_details", None)) is not None:
            tokenizer.save_pretrained(Path(dump) / "tokenizer")
            if hasattr(processor, "save_pretrained"):
                processor.save_pretrained(Path(dump) / "processor")
        self.dataset = Dataset(
            args.prompt_data,
            tokenizer=tokenizer,
            processor=processor,
            max_length=args.rollout_max_prompt_len,
            prompt_key=args.input_key,
            multimodal_keys=getattr(args, "multimodal_keys", None),
            label_key=args.label_key,
            metadata_key=args.metadata_key,
            tool_key=args.tool_key,
            apply_chat_template=args.apply_chat_template,
            apply_chat_template_kwargs=getattr(args, "apply_chat_template_kwargs", None),
            seed=args.rollout_seed,
        )
        if args.rollout_shuffle:
            self.dataset.shuffle(self.epoch_id)

    def _next_prompts(self, num_samples: int) -> list[Sample]:
        if self.dataset is None:
            return [Sample() for _ in range(num_samples)]
        end = self.sample_offset + num_samples
        if end <= len(self.dataset):
            prompts = self.dataset.samples[self.sample_offset : end]
            self.sample_offset = end
            return prompts
        prompts = self.dataset.samples[self.sample_offset :]  # the epoch's rest, then the next
        rest = num_samples - len(prompts)
        self.epoch_id += 1
        if self.args.rollout_shuffle:
            self.dataset.shuffle(self.epoch_id)
        self.sample_offset = rest
        return prompts + self.dataset.samples[:rest]

    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        groups = []
        for prompt in self._next_prompts(num_samples):
            group = []
            for _ in range(self.args.n_samples_per_prompt):
                sample = copy.deepcopy(prompt)
                sample.group_index = self.sample_group_index
                sample.index = self.sample_index
                self.sample_index += 1
                group.append(sample)
            self.sample_group_index += 1
            groups.append(group)
        return groups

    def add_samples(self, samples: list[list[Sample]]) -> None:
        raise RuntimeError(f"Cannot add samples to {type(self).__name__}: it is read-only")

    @staticmethod
    def _state_path(directory: str, rollout_id: int | None) -> str:
        return os.path.join(directory, "rollout", f"global_dataset_state_dict_{rollout_id}.json")

    def save(self, rollout_id: int) -> None:
        directory = getattr(self.args, "save", None)
        if self.dataset is None or not directory:
            return
        path = self._state_path(directory, rollout_id)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        state = {
            "sample_offset": self.sample_offset,
            "epoch_id": self.epoch_id,
            "sample_group_index": self.sample_group_index,
            "sample_index": self.sample_index,
            "metadata": self.metadata,
        }
        with open(path, "w", encoding="utf-8") as f:
            json.dump(state, f)

    def load(self, rollout_id: int | None = None) -> None:
        directory = getattr(self.args, "load", None) or getattr(self.args, "save", None)
        if self.dataset is None or not directory:
            return
        path = self._state_path(directory, rollout_id)
        if not os.path.exists(path):
            log.info("no data source state at %s: starting from the beginning", path)
            return
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
        self.sample_offset = state.get("sample_offset", 0)
        self.epoch_id = state.get("epoch_id", 0)
        self.sample_group_index = state.get("sample_group_index", 0)
        self.sample_index = state.get("sample_index", 0)
        self.metadata = state.get("metadata", {})
        if self.args.rollout_shuffle:
            self.dataset.shuffle(self.epoch_id)


class RolloutDataSourceWithBuffer(RolloutDataSource):
    """RolloutDataSource with Miles' buffer of groups given back (see the module docstring)."""

    def __init__(self, args: Any):
        super().__init__(args)
        self.buffer: list[list[Sample]] = []
        path = getattr(args, "buffer_filter_path", None)
        self.buffer_filter = load_function(path) if path else pop_first

    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        groups = self._get_samples_from_buffer(num_samples)
        if len(groups) < num_samples:
            groups += super().get_samples(num_samples - len(groups))
        return groups

    def _get_samples_from_buffer(self, num_samples: int) -> list[list[Sample]]:
        if not self.buffer or num_samples == 0:
            return []
        return self.buffer_filter(self.args, None, self.buffer, num_samples)

    def add_samples(self, samples: list[list[Sample]]) -> None:
        if not samples:
            return
        n = self.args.n_samples_per_prompt
        for group in samples:
            if not isinstance(group, list):
                raise TypeError(f"add_samples takes groups (lists of Samples), got {type(group)}")
            if len(group) != n:
                raise ValueError(f"a group of {len(group)} samples; n_samples_per_prompt is {n}")
            self.buffer.append(group)

    def update_metadata(self, metadata: dict) -> None:
        self.metadata.update(metadata)

    def get_metadata(self) -> dict:
        return self.metadata

    def get_buffer_length(self) -> int:
        return len(self.buffer)


def pop_first(
    args: Any, rollout_id: int | None, buffer: list[list[Sample]], num_samples: int
) -> list[list[Sample]]:
    """The buffer's first num_samples groups, taken out of it."""
    taken = buffer[:num_samples]
    del buffer[:num_samples]
    return taken
