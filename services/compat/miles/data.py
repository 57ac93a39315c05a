"""Miles' `miles.utils.data`: `Dataset`, the prompt rows of a JSONL (or Parquet) file as Samples.

`Dataset(path, tokenizer, processor, max_length, prompt_key=..., label_key=..., ...)` reads
every row at once into `Sample(prompt, label, metadata, multimodal_inputs)`, as Miles' does:
the prompt is the row's `prompt_key` (with `apply_chat_template`, the chat template applied to
it, tools included, as text); `label` is the row's `label_key` value as it is in the JSON
(text, number, dict, ...); `metadata` its `metadata_key` object, plus `tools`. Prompts longer
than `max_length` tokens are left out. `shuffle(epoch)` orders `samples` by a permutation
seeded with seed + epoch (the same permutation Miles' gives). A path may end in
`@[start:end]` to read only those rows. Miles' train-data helpers (`process_rollout_data`, ...)
are its Ray trainer's and not here.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import random
import re
from collections.abc import Iterator
from typing import Any

from .types import MultimodalTypes, Sample

__all__ = ["Dataset", "filter_long_prompt", "read_file"]

log = logging.getLogger(__name__)


def _split_row_slice(path: str) -> tuple[str, slice | None]:
    match = re.match(r"^(?P<path>.*)@\[(?P<start>-?\d*):(?P<end>-?\d*)\]$", path)
    if match is None:
        return path, None
    start, end = (int(x) if x else None for x in (match["start"], match["end"]))
    return match["path"], slice(start, end)


def read_file(path: str) -> Iterator[dict[str, Any]]:
    """The rows of a .jsonl or .parquet file (`file@[start:end]`: those rows only). A JSONL
    line that is not JSON is logged and skipped, as Miles does."""
    path, rows = _split_row_slice(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"Prompt dataset path '{path}' does not exist.")
    if path.endswith(".jsonl"):
        reader = _jsonl_rows(path)
    elif path.endswith(".parquet"):
        reader = _parquet_rows(path)
    else:
        raise ValueError(f"Unsupported file format: {path}. Supported: .jsonl and .parquet.")
    if rows is not None:
        reader = itertools.islice(reader, rows.start, rows.stop, rows.step)
    yield from reader


def _jsonl_rows(path: str) -> Iterator[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as err:
                log.warning("%s:%d: not JSON, skipped (%s)", path, lineno, err)


def _parquet_rows(path: str) -> Iterator[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as err:
        raise ImportError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from err
    for batch in pq.ParquetFile(path).iter_batches():
        yield from batch.to_pylist()


def _has_media(sample: Sample) -> bool:
    return bool(sample.multimodal_inputs) and any(
        v is not None for v in sample.multimodal_inputs.values()
    )


def filter_long_prompt(
    samples: list[Sample], tokenizer: Any, processor: Any, max_length: int | None
) -> list[Sample]:
    """The samples whose prompt is at most max_length tokens (chat-message prompts are not
    measured: apply the chat template to have them measured)."""
    if max_length is None or not samples:
        return samples
    if not isinstance(samples[0].prompt, str):
        log.warning("prompts are chat messages: not filtered by length (apply the chat template)")
        return samples
    media = [s for s in samples if processor and _has_media(s)]
    text = [s for s in samples if not (processor and _has_media(s))]
    keep = set()
    if text:
        ids = tokenizer([s.prompt for s in text], add_special_tokens=False)["input_ids"]
        keep.update(id(s) for s, one in zip(text, ids, strict=True) if len(one) <= max_length)
    for s in media:
        from .processing_utils import process_vision_info

        out = processor(text=s.prompt, **process_vision_info(s.prompt, processor))
        if len(out["input_ids"][0]) <= max_length:
            keep.add(id(s))
    kept = [s for s in samples if id(s) in keep]
    log.info("left out %d prompts longer than %d tokens", len(samples) - len(kept), max_length)
    return kept


def _build_messages(
    row: dict[str, Any], prompt_key: str, as_conversation: bool, multimodal_keys: dict | None
) -> Any:
    """The row's prompt: its text, or chat messages whose `<image>`-style placeholders become
    content items holding the row's media, in order."""
    prompt = row.get(prompt_key)
    if isinstance(prompt, str):
        if not as_conversation:
            return prompt
        prompt = [{"role": "user", "content": prompt}]
    if not multimodal_keys:
        return prompt
    media: dict[str, tuple[Any, list[Any]]] = {}  # placeholder -> (type, the row's items)
    for type_name, data_key in multimodal_keys.items():
        kind = MultimodalTypes.get(type_name)
        if kind is not None:
            media[kind.placeholder] = (kind, list(row.get(data_key)))
    pattern = "(" + "|".join(re.escape(p) for p in media) + ")"
    for message in prompt:
        content = message["content"]
        if isinstance(content, list):
            continue  # already content items
        if not isinstance(content, str):
            raise ValueError(f"message content is a {type(content).__name__}: text or a list")
        items = []
        for part in re.split(pattern, content):
            if part in media:
                kind, values = media[part]
                items.append({"type": kind.name, kind.name: values.pop(0)})
            elif part:
                items.append({"type": "text", "text": part})
        message["content"] = items
    return prompt


class Dataset:
    """The prompt rows of `path` as Samples (see the module docstring)."""

    def __init__(
        self,
        path: str,
        tokenizer: Any,
        processor: Any,
        max_length: int | None,
        *,
        prompt_key: str = "text",
        multimodal_keys: dict | None = None,
        label_key: str | None = None,
        tool_key: str | None = None,
        metadata_key: str = "metadata",
        seed: int = 42,
        apply_chat_template: bool = False,
        apply_chat_template_kwargs: dict | None = None,
    ):
        samples = []
        for row in read_file(path):
            messages = _build_messages(
                row, prompt_key, apply_chat_template or multimodal_keys is not None, multimodal_keys
            )
            metadata = row.get(metadata_key) or {}
            tools = None
            if tool_key is not None and tool_key in row:
                tools = row[tool_key]
                if isinstance(tools, str):
                    tools = json.loads(tools)
                elif hasattr(tools, "tolist"):  # a numpy array from Parquet
                    tools = tools.tolist()
                if not isinstance(tools, list):
                    raise TypeError(f"{tool_key!r} must hold a list of tools, not {type(tools)}")
                metadata["tools"] = tools
            prompt = messages
            if apply_chat_template:
                prompt = tokenizer.apply_chat_template(
                    messages,
                    tools=tools,
                    tokenize=False,
                    add_generation_prompt=True,
                    **(apply_chat_template_kwargs or {}),
                )
            media = None
            if processor:
                if not isinstance(messages, list):
                    raise TypeError("a model with a processor takes chat-message prompts")
                from .processing_utils import process_vision_info

                media = process_vision_info(messages, processor)
            samples.append(
                Sample(
                    prompt=prompt,
                    label=row[label_key] if label_key is not None else None,
                    metadata=metadata,
                    multimodal_inputs=media,
                )
            )
        self.origin_samples = filter_long_prompt(samples, tokenizer, processor, max_length)
        self.epoch_id = -1
        self.seed = seed
        self.samples = self.origin_samples

    def shuffle(self, new_epoch_id: int) -> None:
        if self.epoch_id == new_epoch_id:
            return
        order = list(range(len(self.origin_samples)))
        random.Random(self.seed + new_epoch_id).shuffle(order)
        self.samples = [self.origin_samples[i] for i in order]
        self.epoch_id = new_epoch_id

    def __getitem__(self, idx: int) -> Sample:
        return self.samples[idx]

    def __len__(self) -> int:
        return len(self.samples)
