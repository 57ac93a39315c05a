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
        max_prompt_len: int | None = None,
        shuffle: bool = False,
        seed: int = 42,
        skip_bad_lines: bool = False,
    ):
        self.path = Path(path)
        self.shuffle = shuffle
        self.seed = seed
        self.position = DataPosition()
        self.stats = LoadStats()
        self._tokenizer = tokenizer
        self._keys = (input_key, label_key, metadata_key, tool_key)
        self._chat = apply_chat_template
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
                    row = self._parse(json.loads(line), len(rows))
                except (ValueError, KeyError, TypeError) as err:
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

    def _parse(self, obj: Any, data_index: int) -> PromptRow:
        input_key, label_key, metadata_key, tool_key = self._keys
        if not isinstance(obj, dict):
            raise TypeError(f"expected a JSON object, got {type(obj).__name__}")
        if input_key not in obj:
            raise KeyError(f"missing --input-key {input_key!r} (keys: {sorted(obj)})")
        prompt = obj[input_key]
        if self._chat:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            tools = obj.get(tool_key) if tool_key else None
            text = self._tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=True
            )
        elif isinstance(prompt, str):
            text = prompt
        else:
            raise TypeError(
                f"{input_key!r} is a {type(prompt).__name__}: pass --apply-chat-template for messages"
            )
        ids = self._tokenizer(text, add_special_tokens=False)["input_ids"]
        metadata = obj.get(metadata_key) or {}
        if not isinstance(metadata, dict):
            raise TypeError(f"--metadata-key {metadata_key!r} must hold a JSON object")
        label = _label_text(obj.get(label_key)) if label_key else ""
        return PromptRow(data_index, text, list(ids), label, metadata)

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
