"""The trainer's prompt data source: JSONL rows -> tokenized prompts, in a resumable order.

It owns the position in the data (epoch, offset), which is part of every checkpoint, so a
resumed run continues with exactly the prompt it would have admitted next. With
--rollout-shuffle each epoch is a fresh permutation seeded by rollout_seed + epoch.

Rows are read and tokenized once at start: a malformed line is an error naming file and line
(--skip-bad-lines counts and skips it instead); prompts longer than --rollout-max-prompt-len
tokens are skipped and counted.

`PluginDataSource` is the same interface around Miles' DataSource class (--data-source-path).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from millstream.common.errors import MillstreamError
from millstream.compat.miles import Sample, make_args
from millstream.compat.plugins import load_function


@dataclass(frozen=True)
class PromptRow:
    data_index: int
    prompt_text: str
    prompt_token_ids: list[int]
    label: str
    metadata: dict[str, Any]
    label_json: str = ""  # the label's JSON when it is no string (_label_json)


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
    """The wire's `label`: a string as it is, any other JSON value as its JSON text."""
    if value is None:
        return ""
    return value if isinstance(value, str) else json.dumps(value)


def _label_json(value: Any) -> str:
    """The wire's `label_json`: the JSON text of a label that is no string (a dict, list,
    number or bool), which the Miles edge decodes back to that value; "" for a string or none."""
    return "" if value is None or isinstance(value, str) else json.dumps(value)


@dataclass(frozen=True)
class RawRow:
    """A JSONL row read and checked as far as needs no tokenizer."""

    prompt: Any  # text; chat messages too with --apply-chat-template
    label: str
    metadata: dict[str, Any]
    tools: Any
    label_json: str = ""


def labels_are_text(cfg: Any) -> bool:
    """A built-in rule (--rm-type) compares labels as text; a custom reward and a remote RM get
    the label's JSON value, whatever it is."""
    rm_type = (cfg.reward.rm_type or "").strip().removeprefix("boxed_")
    return bool(rm_type) and rm_type != "remote_rm" and not cfg.reward.custom_rm_path


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
            "--custom-rm-path, which gets the JSON value)"
        )
    tools = obj.get(tool_key) if tool_key else None
    return RawRow(prompt, _label_text(raw_label), metadata, tools, _label_json(raw_label))


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
        chat_template_kwargs: dict[str, Any] | None = None,
    ):
        self.path = Path(path)
        self.shuffle = shuffle
        self.seed = seed
        self.position = DataPosition()
        self.stats = LoadStats()
        self._tokenizer = tokenizer
        self._keys = (input_key, label_key, metadata_key, tool_key)
        self._chat = apply_chat_template
        self._template_kwargs = dict(chat_template_kwargs or {})  # --apply-chat-template-kwargs
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
                messages, tools=raw.tools, tokenize=False, add_generation_prompt=True,
                **self._template_kwargs,
            )  # fmt: skip
        else:
            text = raw.prompt
        ids = self._tokenizer(text, add_special_tokens=self._add_special)["input_ids"]
        return PromptRow(data_index, text, list(ids), raw.label, raw.metadata, raw.label_json)

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

    def row(self, data_index: int) -> PromptRow:
        return self.rows[data_index]

    def release(self, data_index: int) -> None:
        """The group is terminal (every row stays: they are the data set)."""

    def state_dict(self, rollout_id: int | None = None) -> dict[str, int]:
        return {
            "epoch": self.position.epoch,
            "offset": self.position.offset,
            "rows": len(self.rows),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "plugin" in state:
            raise MillstreamError(
                f"the checkpoint's prompts came from --data-source-path {state['plugin']}, not "
                f"--prompt-data {self.path}: resume with the same data source"
            )
        if state["rows"] != len(self.rows):
            raise MillstreamError(
                f"checkpoint was taken with {state['rows']} prompts but {self.path} now has {len(self.rows)}: "
                "resume with the same --prompt-data and filters"
            )
        self.position = DataPosition(state["epoch"], state["offset"])
        self._order = self._epoch_order(self.position.epoch)


class PluginDataSource:
    """Miles' DataSource class (--data-source-path), with PromptDataSource's interface.

    The class is built once as `cls(args)` (Miles' read-only args). `take(k)` asks it for k
    groups, `get_samples(k)`; of each group the first Sample gives the prompt (text, or chat
    messages, which get the chat template), its label and metadata, and its `tokens` when it
    already has them. Every group gets the next data index (0, 1, 2, ...; epoch 0), which
    makes its group id, whatever `group_index` the class set (that one is kept in the
    metadata as `group_index`). `state_dict(rollout_id)` calls the class's `save(rollout_id)`
    and keeps the rows still in flight; `load_state_dict` calls `load(rollout_id)`, so a
    resumed run re-admits exactly those groups and then asks the class for new ones.
    """

    FLAG = "--data-source-path"

    def __init__(
        self,
        path: str,
        cfg: Any,
        tokenizer: Any,
        *,
        apply_chat_template: bool = False,
        prompt_special_tokens: str = "tokenizer",
        chat_template_kwargs: dict[str, Any] | None = None,
    ):
        self.path = path
        self.position = DataPosition()
        self._tokenizer = tokenizer
        self._chat = apply_chat_template
        self._template_kwargs = dict(chat_template_kwargs or {})
        self._add_special = prompt_special_tokens == "tokenizer" and not apply_chat_template
        self.rows: dict[int, PromptRow] = {}  # data index -> row, until the group is terminal
        cls = load_function(path, self.FLAG)
        try:
            self.plugin = cls(make_args(cfg))
        except Exception as err:
            raise MillstreamError(
                f"{self.FLAG} {path}: {getattr(cls, '__name__', cls)}(args) raised "
                f"{type(err).__name__}: {err}"
            ) from err

    def take(self, k: int) -> list[tuple[PromptRow, int]]:
        groups = self._call("get_samples", k)
        if not isinstance(groups, list) or len(groups) != k:
            got = len(groups) if isinstance(groups, list) else type(groups).__name__
            raise MillstreamError(
                f"{self.FLAG} {self.path}: get_samples({k}) returned {got} groups; it must "
                "return a list of exactly as many groups as asked (each a list of Samples)"
            )
        out = []
        for group in groups:
            first = group[0] if isinstance(group, list) and group else group
            if not isinstance(first, Sample):
                raise MillstreamError(
                    f"{self.FLAG} {self.path}: get_samples returned {type(first).__name__} "
                    "where a group (a list of millstream.compat.miles / miles.utils.types "
                    "Sample) belongs"
                )
            row = self._row(first, self.position.offset)
            self.rows[row.data_index] = row
            self.position.offset += 1
            out.append((row, 0))
        return out

    def _row(self, sample: Sample, data_index: int) -> PromptRow:
        prompt = sample.prompt
        if not isinstance(prompt, str):  # text is as the class made it (Miles': templated)
            messages = prompt
            text = self._tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, **self._template_kwargs
            )
        else:
            text = prompt
        ids = (
            list(sample.tokens)
            if sample.tokens and not sample.response_length
            else list(self._tokenizer(text, add_special_tokens=self._add_special)["input_ids"])
        )
        metadata = dict(sample.metadata or {})
        if sample.group_index is not None:
            metadata.setdefault("group_index", sample.group_index)
        label = sample.label
        return PromptRow(data_index, text, ids, _label_text(label), metadata, _label_json(label))

    def row(self, data_index: int) -> PromptRow:
        return self.rows[data_index]

    def release(self, data_index: int) -> None:
        """The group is terminal: its row is no longer needed for a resume."""
        self.rows.pop(data_index, None)

    def state_dict(self, rollout_id: int | None = None) -> dict[str, Any]:
        if rollout_id is not None:
            self._call("save", rollout_id)
        return {
            "plugin": self.path,
            "offset": self.position.offset,
            "rollout_id": rollout_id,
            "rows": [
                [r.data_index, r.prompt_text, r.prompt_token_ids, r.label, r.metadata, r.label_json]
                for r in self.rows.values()
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("plugin") != self.path:
            raise MillstreamError(
                f"the checkpoint's prompts came from {state.get('plugin') or '--prompt-data'}, "
                f"not {self.FLAG} {self.path}: resume with the same data source"
            )
        self.position = DataPosition(0, state["offset"])
        self.rows = {r[0]: PromptRow(*r) for r in state["rows"]}
        self._call("load", state["rollout_id"])

    def _call(self, method: str, *args: Any) -> Any:
        try:
            return getattr(self.plugin, method)(*args)
        except Exception as err:
            raise MillstreamError(
                f"{self.FLAG} {self.path}: {method}({', '.join(map(repr, args))}) raised "
                f"{type(err).__name__}: {err}"
            ) from err


class EmptyPrompts:
    """Miles' default data source without its data set (--disable-rollout-global-dataset):
    each group starts from an empty Sample (no prompt, no label), which the run's custom
    generate or rollout function fills; save and load keep nothing."""

    def __init__(self, args: Any):
        self.args = args

    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        return [[Sample()] for _ in range(num_samples)]

    def save(self, rollout_id: int) -> None:
        pass

    def load(self, rollout_id: int | None = None) -> None:
        pass


EMPTY_PROMPTS = f"{__name__}.{EmptyPrompts.__name__}"
