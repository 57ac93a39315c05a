"""The prompt data source: keys, chat template, shuffling per epoch, resumable position, bad input."""

from __future__ import annotations

import json

import pytest

from millstream.common.errors import MillstreamError
from millstream.trainer.data import PromptDataSource


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from tests.support.tiny_model import build_tokenizer

    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_rows_keys_and_labels(tmp_path, tokenizer):
    path = _write(
        tmp_path / "p.jsonl", [{"q": "1+1=", "a": 2, "m": {"k": 1}}, {"q": "2+2=", "a": "4"}]
    )
    src = PromptDataSource(path, tokenizer, input_key="q", label_key="a", metadata_key="m")
    (row, epoch), (row2, _) = src.take(2)
    assert (row.prompt_text, row.label, row.metadata, epoch) == ("1+1=", "2", {"k": 1}, 0)
    assert tokenizer.decode(row.prompt_token_ids) == "1+1=" and row2.label == "4"


def test_chat_template_for_strings_and_messages(tmp_path, tokenizer):
    path = _write(
        tmp_path / "p.jsonl", [{"input": "hi"}, {"input": [{"role": "user", "content": "yo"}]}]
    )
    src = PromptDataSource(path, tokenizer, apply_chat_template=True)
    texts = [row.prompt_text for row, _ in src.take(2)]
    assert texts == [
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
        "<|im_start|>user\nyo<|im_end|>\n<|im_start|>assistant\n",
    ]


def test_shuffle_is_per_epoch_and_deterministic(tmp_path, tokenizer):
    path = _write(tmp_path / "p.jsonl", [{"input": str(i)} for i in range(20)])
    a = PromptDataSource(path, tokenizer, shuffle=True, seed=7)
    b = PromptDataSource(path, tokenizer, shuffle=True, seed=7)
    first = [r.data_index for r, _ in a.take(20)]
    second = [r.data_index for r, e in a.take(20)]
    assert sorted(first) == list(range(20)) and first != list(range(20)) and first != second
    assert [r.data_index for r, _ in b.take(40)] == first + second


def test_position_resumes_exactly(tmp_path, tokenizer):
    path = _write(tmp_path / "p.jsonl", [{"input": str(i)} for i in range(10)])
    a = PromptDataSource(path, tokenizer, shuffle=True, seed=1)
    a.take(13)
    state = a.state_dict()
    expected = [(r.data_index, e) for r, e in a.take(9)]
    b = PromptDataSource(path, tokenizer, shuffle=True, seed=1)
    b.load_state_dict(state)
    assert [(r.data_index, e) for r, e in b.take(9)] == expected


def test_malformed_line_names_file_and_line(tmp_path, tokenizer):
    path = _write(tmp_path / "p.jsonl", [{"input": "ok"}, "{not json", {"input": "ok2"}])
    with pytest.raises(MillstreamError, match=r"p\.jsonl:2: .*--skip-bad-lines"):
        PromptDataSource(path, tokenizer)
    src = PromptDataSource(path, tokenizer, skip_bad_lines=True)
    assert (src.stats.rows, src.stats.bad_lines, src.stats.bad_line_numbers) == (2, 1, [2])


def test_missing_input_key_names_the_key(tmp_path, tokenizer):
    path = _write(tmp_path / "p.jsonl", [{"prompt": "x"}])
    with pytest.raises(MillstreamError, match=r"p\.jsonl:1: .*'input'"):
        PromptDataSource(path, tokenizer)


def test_long_prompts_are_skipped_and_counted(tmp_path, tokenizer):
    path = _write(tmp_path / "p.jsonl", [{"input": "short"}, {"input": "x" * 50}])
    src = PromptDataSource(path, tokenizer, max_prompt_len=10)
    assert (src.stats.rows, src.stats.skipped_long) == (1, 1)


def test_missing_file_is_a_clear_error(tmp_path, tokenizer):
    with pytest.raises(MillstreamError, match="does not exist"):
        PromptDataSource(tmp_path / "nope.jsonl", tokenizer)


def test_a_built_in_reward_refuses_labels_that_are_not_text():
    from millstream.trainer.data import parse_row

    line = json.dumps({"prompt": "1+1=", "label": {"answer": 2}})
    with pytest.raises(TypeError, match="--label-key 'label' holds a JSON dict"):
        parse_row(line, "prompt", "label", "metadata", None, False, text_label=True)
    assert parse_row(line, "prompt", "label", "metadata", None, False).label == '{"answer": 2}'
    number = json.dumps({"prompt": "1+1=", "label": 2})
    assert (
        parse_row(number, "prompt", "label", "metadata", None, False, text_label=True).label == "2"
    )


def _bos_tokenizer(path):
    """The tiny tokenizer, but one that adds a BOS to plain text (as Llama's and Gemma's do)."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    from tests.support.tiny_model import build_tokenizer

    base = build_tokenizer(path)
    backend = base.backend_tokenizer
    bos_id = base.convert_tokens_to_ids("<|im_start|>")
    backend.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos_id)]
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>"
    )
    tok.chat_template = base.chat_template
    return tok, bos_id


def test_plain_prompt_follows_the_tokenizer_unless_miles(tmp_path):
    tok, bos = _bos_tokenizer(tmp_path / "tok")
    assert tok("1+1=")["input_ids"][0] == bos  # what HF generate / TRL would feed the model
    path = _write(tmp_path / "p.jsonl", [{"input": "1+1="}])
    ((row, _),) = PromptDataSource(path, tok).take(1)  # default: --prompt-special-tokens tokenizer
    assert row.prompt_token_ids == tok("1+1=")["input_ids"] and row.prompt_token_ids[0] == bos
    ((row, _),) = PromptDataSource(path, tok, prompt_special_tokens="miles").take(1)
    assert row.prompt_token_ids == tok("1+1=", add_special_tokens=False)["input_ids"]
    assert bos not in row.prompt_token_ids
    # A chat template writes its own special tokens: none added on top, in either mode.
    for mode in ("tokenizer", "miles"):
        src = PromptDataSource(path, tok, apply_chat_template=True, prompt_special_tokens=mode)
        ((row, _),) = src.take(1)
        assert row.prompt_token_ids == tok(row.prompt_text, add_special_tokens=False)["input_ids"]


def test_arith_tokenizer_adds_nothing_so_the_default_keeps_make_run(tmp_path):
    from pathlib import Path

    from transformers import AutoTokenizer

    model = Path(__file__).resolve().parents[3] / "examples" / "arith" / "model"
    tok = AutoTokenizer.from_pretrained(model)
    path = _write(tmp_path / "p.jsonl", [{"input": "12+34="}])
    ids = [
        PromptDataSource(path, tok, prompt_special_tokens=mode).take(1)[0][0].prompt_token_ids
        for mode in ("tokenizer", "miles")
    ]
    assert ids[0] == ids[1] == tok("12+34=", add_special_tokens=False)["input_ids"]


LABELS = [{"answer": 2, "unit": "cm"}, ["a", "b"], 7, 2.5, True, "4", None]


def test_a_label_of_any_json_type_travels_as_json(tmp_path, tokenizer):
    """The label key's value, whatever its JSON type, reaches the wire as JSON text (label_json)
    beside its text (label), from the JSONL through admission's PromptGroup to the rollout's
    wire Samples, and back to the value at the Miles edge."""
    from millstream.compat.miles import sample_from_pb
    from millstream.rollout.generate import new_sample
    from millstream.trainer.admission import Admission

    rows = [{"q": f"{i}+1=", "a": label} for i, label in enumerate(LABELS)]
    rows[-1].pop("a")  # no label at all
    src = PromptDataSource(
        _write(tmp_path / "p.jsonl", rows), tokenizer, input_key="q", label_key="a"
    )
    admission = Admission(None, "s", src, 1, 2, 0)
    for (row, epoch), label in zip(src.take(len(LABELS)), LABELS, strict=True):
        text = "" if label is None else label if isinstance(label, str) else json.dumps(label)
        is_json = label is not None and not isinstance(label, str)
        assert (row.label, row.label_json) == (text, text if is_json else "")
        group = admission._message("g", row, epoch, 0)
        assert (group.label, group.label_json) == (row.label, row.label_json)
        wire = new_sample(group, 1)
        assert (wire.label, wire.label_json) == (row.label, row.label_json)
        assert sample_from_pb(wire).label == ("" if label is None else label)


def test_labels_are_text_only_for_built_in_rules():
    from types import SimpleNamespace

    from millstream.trainer.data import labels_are_text

    def cfg(rm_type, custom=None):
        return SimpleNamespace(reward=SimpleNamespace(rm_type=rm_type, custom_rm_path=custom))

    assert labels_are_text(cfg("math")) and labels_are_text(cfg("boxed_f1"))
    assert not labels_are_text(cfg("remote_rm")) and not labels_are_text(cfg("boxed_remote_rm"))
    assert not labels_are_text(cfg("math", "pkg.mod.fn")) and not labels_are_text(cfg(None))


def test_a_plugin_row_checkpointed_before_label_json_still_loads():
    from millstream.trainer.data import PromptRow

    assert PromptRow(*[3, "p", [1], "x", {}]).label_json == ""  # label text only


def test_a_miles_data_sources_label_keeps_its_json(tmp_path, tokenizer):
    from millstream.common.config import parse_run_config
    from millstream.trainer.data import PluginDataSource

    rows = [{"q": "1+1=", "a": {"answer": 2}}, {"q": "2+2=", "a": "4"}]
    data = _write(tmp_path / "p.jsonl", rows)
    cfg = parse_run_config(
        ["--run-id", "t", "--rollout-batch-size", "2", "--prompt-data", str(data),
         "--input-key", "q", "--label-key", "a", "--run-dir", str(tmp_path),
         "--data-source-path", "tests.support.miles_plugins.JsonlDataSource"],
        mode="async",
    )  # fmt: skip
    source = PluginDataSource(cfg.rollout.data_source_path, cfg, tokenizer)
    (row, _), (row2, _) = source.take(2)
    assert (row.label, row.label_json) == ('{"answer": 2}', '{"answer": 2}')
    assert (row2.label, row2.label_json) == ("4", "")
    state = json.loads(json.dumps(source.state_dict()))
    resumed = PluginDataSource(cfg.rollout.data_source_path, cfg, tokenizer)
    resumed.load_state_dict(state)
    assert resumed.row(0) == row and resumed.row(1) == row2


def test_the_byte_bounds_first_guess_counts_the_longest_prompt(tmp_path, tokenizer):
    """--max-buffer-bytes' prior (build.longest_prompt): every sample carries its prompt, so
    the first wave is sized with the data set's longest, or --rollout-max-prompt-len."""
    from millstream.common.config import parse_run_config
    from millstream.trainer import build
    from millstream.trainer.admission import prior_group_bytes

    path = tmp_path / "d.jsonl"
    _write(path, [{"input": "1+1="}, {"input": "12+34+56+78="}])
    src = PromptDataSource(path, tokenizer)
    cfg = parse_run_config(["--rollout-batch-size", "2"], mode="sync")
    longest = len(tokenizer("12+34+56+78=")["input_ids"])
    assert (
        build.longest_prompt(cfg, src) == longest == max(len(r.prompt_token_ids) for r in src.rows)
    )
    assert prior_group_bytes(8, 64, longest) > prior_group_bytes(8, 64)
    flags = ["--rollout-batch-size", "2", "--rollout-max-prompt-len", "300"]
    assert build.longest_prompt(parse_run_config(flags, mode="sync"), object()) == 300  # type: ignore[arg-type]
