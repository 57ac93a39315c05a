"""The trainer's prompt data source: JSONL rows -> tokenized prompts, in a resumable order.

It owns the position in the data (epoch, offset), which is part of every checkpoint, so a
resumed run continues with exactly the prompt it would have admitted next. With
--rollout-shuffle each epoch is a fresh permutation seeded by rollout_seed + epoch.

Rows are read and tokenized once at start: a malformed line is an error naming file and line
(--skip-bad-lines counts and skips it instead); prompts longer than --rollout-max-prompt-len
tokens are skipped and counted.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from millstream.common.errors import MillstreamError


@dataclass(frozen=True)
class PromptRow:
    data_index: int
    prompt_text: str
    prompt_token_ids: list[int]
    label: str
    metadata: dict[str, Any]


@dataclass
class DataPosition:
    epoch: int = 0
    offset: int = 0


@dataclass
class LoadStats:
    rows: int = 0
    bad_lines: int = 0
    skipped_long: int = 0
    bad_line_numbers: list[int] = field(default_factory=list)


def _label_text(value: Any) -> str:
    if value is None:
        return ""
    return value if isinstance(value, str) else json.dumps(value)


@dataclass(frozen=True)
class RawRow:
    """A JSONL row read and checked as far as needs no tokenizer."""

    prompt: Any  # text; chat messages too with --apply-chat-template
    label: str
    metadata: dict[str, Any]
    tools: Any


def labels_are_text(cfg: Any) -> bool:
    """A built-in --rm-type compares labels as text; a custom reward gets any JSON as text."""
    return bool(cfg.reward.rm_type) and not cfg.reward.custom_rm_path


# What `parse_row` raises on a malformed line (json.JSONDecodeError is a ValueError).
ROW_ERRORS = (ValueError, KeyError, TypeError)


def parse_row(
    line: str,
    input_key: str,
    label_key: str | None,
    metadata_key: str,
    tool_key: str | None,
    chat: bool,
    text_label: bool = False,
) -> RawRow:
    """One line of prompt data; one of ROW_ERRORS, naming the key, when it is malformed.
    The start-up check (preflight) reads the first rows with it before any tokenizer loads."""
    obj = json.loads(line)
    if not isinstance(obj, dict):
        raise TypeError(f"expected a JSON object, got {type(obj).__name__}")
    if input_key not in obj:
        raise KeyError(f"missing --input-key {input_key!r} (keys: {sorted(obj)})")
    prompt = obj[input_key]
    if not chat and not isinstance(prompt, str):
        raise TypeError(
            f"{input_key!r} is a {type(prompt).__name__}: pass --apply-chat-template for messages"
        )
    metadata = obj.get(metadata_key) or {}
    if not isinstance(metadata, dict):
        raise TypeError(f"--metadata-key {metadata_key!r} must hold a JSON object")
    raw_label = obj.get(label_key) if label_key else None
    if text_label and isinstance(raw_label, dict | list | bool):
        raise TypeError(
            f"--label-key {label_key!r} holds a JSON {type(raw_label).__name__}: a built-in "
            "--rm-type compares text, so give a string or a number (or score it with "
            "--custom-rm-path, which gets the JSON text)"
        )
    label = _label_text(raw_label)
    tools = obj.get(tool_key) if tool_key else None
    return RawRow(prompt, label, metadata, tools)


class PromptDataSource:
    def __init__(
        self,
        path: str | Path,
        tokenizer: Any,
        *,
        input_key: str = "input",
        label_key: str | None = None,
        metadata_key: str = "metadata",
        tool_key: str | None = None,
        apply_chat_template: bool = False,
        prompt_special_tokens: str = "tokenizer",
        max_prompt_len: int | None = None,
        shuffle: bool = False,
        seed: int = 42,
        skip_bad_lines: bool = False,
        text_labels: bool = False,
    ):
        self.path = Path(path)
        self.shuffle = shuffle
        self.seed = seed
        self.position = DataPosition()
        self.stats = LoadStats()
        self._tokenizer = tokenizer
        self._keys = (input_key, label_key, metadata_key, tool_key)
        self._chat = apply_chat_template
        # --prompt-special-tokens: the tokenizer's own special tokens on plain text (HF's
        # default), none on chat-templated text (the template wrote them); "miles": never.
        self._add_special = prompt_special_tokens == "tokenizer" and not apply_chat_template
        self._text_labels = text_labels
        self.rows = self._load(max_prompt_len, skip_bad_lines)
        if not self.rows:
            raise MillstreamError(f"{self.path}: no usable prompts ({self.stats})")
        self._order = self._epoch_order(0)

    def _load(self, max_prompt_len: int | None, skip_bad_lines: bool) -> list[PromptRow]:
        if not self.path.is_file():
            raise MillstreamError(f"prompt data {self.path} does not exist (--prompt-data)")
        rows: list[PromptRow] = []
        with self.path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    row = self._tokenized(
                        parse_row(line, *self._keys, self._chat, self._text_labels), len(rows)
                    )
                except ROW_ERRORS as err:
                    if not skip_bad_lines:
                        raise MillstreamError(
                            f"{self.path}:{lineno}: {err} (fix the line, or pass --skip-bad-lines)"
                        ) from None
                    self.stats.bad_lines += 1
                    self.stats.bad_line_numbers.append(lineno)
                    continue
                if max_prompt_len is not None and len(row.prompt_token_ids) > max_prompt_len:
                    self.stats.skipped_long += 1
                    continue
                rows.append(row)
        self.stats.rows = len(rows)
        return rows

    def _tokenized(self, raw: RawRow, data_index: int) -> PromptRow:
        if self._chat:
            prompt = raw.prompt
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            text = self._tokenizer.apply_chat_template(
                messages, tools=raw.tools, tokenize=False, add_generation_prompt=True
            )
        else:
            text = raw.prompt
        ids = self._tokenizer(text, add_special_tokens=self._add_special)["input_ids"]
        return PromptRow(data_index, text, list(ids), raw.label, raw.metadata)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        return order

    def take(self, k: int) -> list[tuple[PromptRow, int]]:
        """The next k prompts with their epoch, crossing epoch boundaries as needed."""
        out = []
        for _ in range(k):
            if self.position.offset >= len(self._order):
                self.position = DataPosition(self.position.epoch + 1, 0)
                self._order = self._epoch_order(self.position.epoch)
            out.append((self.rows[self._order[self.position.offset]], self.position.epoch))
            self.position.offset += 1
        return out

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.position.epoch,
            "offset": self.position.offset,
            "rows": len(self.rows),
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["rows"] != len(self.rows):
            raise MillstreamError(
                f"checkpoint was taken with {state['rows']} prompts but {self.path} now has {len(self.rows)}: "
                "resume with the same --prompt-data and filters"
            )
        self.position = DataPosition(state["epoch"], state["offset"])
        self._order = self._epoch_order(self.position.epoch)
