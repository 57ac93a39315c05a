"""Miles' plugin interfaces (compat/miles/): the read-only `args`, the Sample and its wire
conversion both ways, and each hook called with Miles' signature (reward, group reward,
dynamic-sampling filter, buffer filter; the whole-batch rollout function refused)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import pickle
import subprocess
import sys

import httpx
import pytest

from millstream.common.config import GROUPS, parse_run_config
from millstream.common.errors import MillstreamError
from millstream.common.plugin_errors import PluginFailed
from millstream.common.types import PromptGroup, SampleGroup, SampleStatus, Verdict
from millstream.common.types import Sample as PbSample
from millstream.compat.miles import (
    DynamicFilterOutput,
    Sample,
    check_not_old_signature,
    check_rollout_function,
    groups_from_pb,
    make_args,
    named_error,
    sample_from_pb,
    sample_to_pb,
)
from millstream.reward.filters import apply_filter
from millstream.reward.rewarder import Rewarder
from millstream.reward.scorer import GroupScorer
from millstream.rollout.worker import load_buffer_filter, load_rollout_function

MILES = "tests.support.miles_plugins"


def make_cfg(*flags: str):
    return parse_run_config(["--run-id", "t", "--rollout-batch-size", "2", *flags], mode="async")


def pb_sample(**overrides) -> PbSample:
    fields = {
        "group_id": "g7",
        "index": 1,
        "prompt_token_ids": [5, 6, 7],
        "response_token_ids": [8, 9],
        "response_text": "42",
        "label": "42",
        "loss_mask": [1, 0],
        "rollout_logprobs": [-0.5, -0.25],
        "weight_versions": [3, 4],
        "status": SampleStatus.SAMPLE_STATUS_TRUNCATED,
        "reward": 0.75,
        "metadata_json": json.dumps({"rm_type": "math", "turns": [1, 2]}),
        "failure_reason": "",
        "finish_reason": "length",
    }
    fields.update(overrides)
    return PbSample(**fields)


def make_group(responses, labels=None, gid="g", metadata=None) -> SampleGroup:
    labels = labels or ["4"] * len(responses)
    meta = json.dumps(metadata) if metadata else ""
    return SampleGroup(
        prompt=PromptGroup(group_id=gid, prompt_text="2+2?", n_samples=len(responses)),
        samples=[
            PbSample(group_id=gid, index=i, response_text=r, label=lab, metadata_json=meta)
            for i, (r, lab) in enumerate(zip(responses, labels, strict=True))
        ],
    )


# -- args --------------------------------------------------------------------------------------


def test_args_has_every_flag_by_its_miles_name_and_is_read_only():
    cfg = make_cfg("--n-samples-per-prompt", "4", "--rm-type", "math", "--rollout-stop", "x")
    args = make_args(cfg)
    names = {f.name for _, cls, _ in GROUPS for f in dataclasses.fields(cls)}
    assert set(dir(args)) == names | {"mode"}
    assert (args.rollout_batch_size, args.n_samples_per_prompt) == (2, 4)
    assert (args.rm_type, args.mode, args.custom_rm_path) == ("math", "async", None)
    assert args.rollout_stop == ("x",)  # lists come as tuples: nothing in args is mutable
    assert getattr(args, "router_ip_nope", "default") == "default"
    assert getattr(args, "sglang_router_ip_nope", "default") is None  # SGLang's: not given
    with pytest.raises(AttributeError, match="no attribute 'nope': no such flag"):
        _ = args.nope
    with pytest.raises(AttributeError, match=r"args is read-only \(setting args.rm_type\)"):
        args.rm_type = "f1"
    with pytest.raises(AttributeError, match="read-only"):
        args.brand_new = 1
    with pytest.raises(AttributeError, match="read-only"):
        del args.rm_type
    assert args.rm_type == "math" and "rm_type" in args
    assert pickle.loads(pickle.dumps(args)).to_dict() == args.to_dict()  # Celery, processes


def test_common_miles_imports_without_torch():
    code = "import sys, millstream.compat.miles; assert 'torch' not in sys.modules, 'torch'"
    subprocess.run([sys.executable, "-c", code], check=True)


# -- Sample <-> wire ---------------------------------------------------------------------------


def test_wire_sample_to_miles_and_back_is_the_same_message():
    pb = pb_sample()
    s = sample_from_pb(pb, prompt="What is 6*7?", group_index=9, scored=True)
    assert s.tokens == [5, 6, 7, 8, 9] and s.response_length == 2
    assert (s.prompt, s.response, s.label, s.reward) == ("What is 6*7?", "42", "42", 0.75)
    assert s.status == Sample.Status.TRUNCATED and s.metadata == {
        "rm_type": "math",
        "turns": [1, 2],
    }
    assert (s.index, s.group_index, s.group_id, s.finish_reason) == (1, 9, "g7", "length")
    assert s.loss_mask == [1, 0] and s.rollout_log_probs == [-0.5, -0.25]
    assert s.weight_versions == ["3", "4"] and s.effective_response_length == 1
    assert sample_to_pb(s) == pb
    for status in SampleStatus.values():
        one = pb_sample(status=status, metadata_json="", loss_mask=[], rollout_logprobs=[])
        assert sample_to_pb(sample_from_pb(one, scored=True)) == one
    empty = PbSample(group_id="e")
    assert sample_to_pb(sample_from_pb(empty)) == empty


def test_miles_sample_to_wire_and_back_is_the_same_sample():
    s = Sample(
        index=0, prompt="p", tokens=[1, 2, 3], response="ab", response_length=2, label="x",
        reward=1.0, loss_mask=[1, 1], weight_versions=["7", "7"], rollout_log_probs=[-1.0, -2.0],
        status=Sample.Status.ABORTED, metadata={"k": "v"}, group_id="g", finish_reason="abort",
    )  # fmt: skip
    back = sample_from_pb(sample_to_pb(s), prompt="p", scored=True)
    assert back == s
    assert sample_from_pb(sample_to_pb(s)).reward is None  # before scoring: not a 0
    assert Sample.from_dict(s.to_dict()) == s
    with pytest.raises(TypeError, match="--reward-key"):
        sample_to_pb(dataclasses.replace(s, reward={"acc": 1.0}))
    with pytest.raises(ValueError, match="does not fit"):
        sample_to_pb(dataclasses.replace(s, response_length=4))
    with pytest.raises(ValueError, match="loss_mask has 3 entries for 2 response tokens"):
        sample_to_pb(dataclasses.replace(s, loss_mask=[0, 1, 1]))
    with pytest.raises(ValueError, match="rollout_log_probs has 1 entries"):
        sample_to_pb(dataclasses.replace(s, rollout_log_probs=[-1.0]))
    assert Sample(reward={"acc": 0.5}).get_reward_value(make_args(make_cfg("--reward-key", "acc")))


def test_not_json_metadata_is_kept_not_dropped():
    s = sample_from_pb(pb_sample(metadata_json="plain text"))
    assert s.metadata == {"metadata_json": "plain text"}


def test_groups_become_miles_buffer_with_prompt_and_data_index():
    g = PromptGroup(group_id="p", prompt_text="hi", data_index=12, partial_samples=[pb_sample()])
    [[s]] = groups_from_pb([g])
    assert (s.prompt, s.group_index, s.group_id) == ("hi", 12, "g7") and s.reward is None


# -- the hooks, with Miles' signatures ---------------------------------------------------------


def score(cfg, *groups):
    async def go():
        rewarder = Rewarder(cfg)
        try:
            scorer = GroupScorer(cfg, rewarder)
            return [await scorer.score(g) for g in groups]
        finally:
            await rewarder.aclose()

    return asyncio.run(go())


def rewards(scored) -> list[float]:
    return [s.reward for s in scored.group.samples]


def test_miles_reward_and_filter_score_and_filter_groups():
    cfg = make_cfg(
        "--custom-rm-path", f"{MILES}.custom_rm",
        "--dynamic-sampling-filter-path", f"{MILES}.filter_function",
    )  # fmt: skip
    mixed, same, bonus = score(
        cfg,
        make_group(["4", "5"], gid="mixed"),
        make_group(["4", "4"], gid="same"),
        make_group(["4", "5"], gid="bonus", metadata={"bonus": 0.5}),
    )
    assert mixed.verdict == Verdict.VERDICT_KEPT and rewards(mixed) == [1.0, 0.0]
    assert same.verdict == Verdict.VERDICT_FILTERED and same.reason == "zero_std_1.0"
    assert rewards(bonus) == [1.5, 0.5]


def test_miles_group_reward_gets_the_whole_group():
    cfg = make_cfg("--custom-rm-path", f"{MILES}.batched_custom_rm", "--group-rm")
    [out] = score(cfg, make_group(["a", "abc", "ab"]))
    assert out.verdict == Verdict.VERDICT_KEPT and rewards(out) == [0.0, 1.0, 0.0]


def test_a_reward_error_names_the_plugin_path():
    # custom_rm asserts args.custom_rm_path ends with custom_rm: under another name it raises
    cfg = make_cfg("--custom-rm-path", f"{MILES}:custom_rm", "--reward-retries", "0")
    [ok] = score(cfg, make_group(["4"]))
    assert ok.verdict == Verdict.VERDICT_KEPT
    cfg = make_cfg("--custom-rm-path", "tests.support.reward_plugins.misbehaving",
                   "--reward-retries", "0")  # fmt: skip
    [out] = score(cfg, make_group(["x"], labels=["boom"]))
    assert out.verdict == Verdict.VERDICT_FAILED
    assert out.reason == (
        "reward: --custom-rm-path tests.support.reward_plugins.misbehaving raised "
        "RuntimeError: reward exploded on 'x'"
    )
    err = named_error(KeyError("k"), "--buffer-filter-path", "m.f")
    assert isinstance(err, RuntimeError) and "(--buffer-filter-path m.f)" in str(err)


@pytest.mark.parametrize(
    ("answer", "keep", "reason"),
    [
        (False, False, None),
        (DynamicFilterOutput(keep=True), True, None),
        ({"keep": False, "reason": "r"}, False, "r"),
    ],
)
def test_filter_answers_are_read_as_miles_reads_them(answer, keep, reason):
    calls = []

    async def fn(args, samples, **kwargs):
        calls.append((args, samples, kwargs))
        return answer

    group = make_group(["4", "5"])
    group.samples[0].reward = 1.0
    out = asyncio.run(apply_filter(fn, group, "ARGS"))
    assert (out.keep, out.reason) == (keep, reason)
    [(args, samples, kwargs)] = calls
    assert args == "ARGS" and kwargs == {}
    assert [s.reward for s in samples] == [1.0, 0.0] and samples[0].prompt == "2+2?"


def test_buffer_filter_from_miles_docs_orders_and_names_its_path_on_error():
    fn = load_buffer_filter(f"{MILES}.buffer_filter")
    short = [Sample(group_id="s", response_length=1)]
    long = [Sample(group_id="l", response_length=5)]
    buffer = [short, long]
    args = make_args(make_cfg())
    assert fn(args, None, buffer, 2) == [long, short] and buffer == []
    with pytest.raises(PluginFailed, match=r"--buffer-filter-path tests\.support\.miles_plugins"):
        fn(args, None, [[Sample()]], "two")  # a bug in the filter (min of int and str)


def test_a_miles_whole_batch_rollout_function_is_refused_by_the_worker():
    with pytest.raises(MillstreamError, match="drives a whole rollout batch"):
        load_rollout_function("tests.support.rollout_plugins.miles_generate_rollout")
    assert load_rollout_function("tests.support.rollout_plugins.two_turn")
    check_rollout_function(len, "builtins.len")  # no signature to read: left alone


def test_a_plugin_written_for_the_old_signatures_is_refused_saying_what_to_write(tmp_path):
    def reward(sample, cfg):
        return 1.0

    def keep(samples, cfg):
        return True

    def order(groups):
        return groups

    for fn, flag, want in [
        (reward, "--custom-rm-path", "write fn(args, sample) -> float"),
        (keep, "--custom-rm-path --group-rm", "write fn(args, samples) -> list[float]"),
        (keep, "--dynamic-sampling-filter-path", "fn(args, samples, **kwargs) -> Dynamic"),
        (order, "--buffer-filter-path", "fn(args, rollout_id, buffer, num_samples)"),
    ]:
        with pytest.raises(MillstreamError, match=rf"^{flag.split()[0]} my.fn takes .*old"):
            check_not_old_signature(fn, flag, "my.fn")
        with pytest.raises(MillstreamError) as info:
            check_not_old_signature(fn, flag, "my.fn")
        assert want in str(info.value)
    # Miles' own signatures pass
    check_not_old_signature(lambda args, sample: 1.0, "--custom-rm-path", "m.f")
    check_not_old_signature(lambda args, samples, **kw: True, "--dynamic-sampling-filter-path", "f")


# -- Miles' imports, the data source, the per-sample loss filter ------------------------------


def test_a_plugin_keeps_miles_imports_and_gets_millstreams_types():
    import millstream.compat.miles as ours
    from millstream.compat.plugins import load_function

    cls = load_function(f"{MILES}.JsonlDataSource", "--data-source-path")
    import miles.rollout.data_source
    import miles.utils.types

    assert miles.utils.types.Sample is ours.Sample and issubclass(cls, ours.DataSource)
    assert miles.rollout.data_source.DataSource is ours.DataSource


def test_a_miles_module_not_stood_in_for_is_named(tmp_path, monkeypatch):
    (tmp_path / "uses_miles_timer.py").write_text(
        "from miles.utils.timer import Timer\n\ndef reward(args, sample):\n    return 1.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    from millstream.compat.plugins import load_function

    with pytest.raises(MillstreamError) as info:
        load_function("uses_miles_timer.reward", "--custom-rm-path")
    message = str(info.value)
    assert "imports 'miles.utils.timer', which is Miles' and not installed" in message
    assert "miles.utils.types" in message


def _tokens_group(gid="g", eval_=False) -> SampleGroup:
    return SampleGroup(
        prompt=PromptGroup(group_id=gid, prompt_text="1+1=", n_samples=3, is_eval=eval_),
        samples=[
            PbSample(group_id=gid, index=i, response_text="2" * (i + 1),
                     response_token_ids=[7] * (i + 1), loss_mask=[1] * (i + 1))
            for i in range(3)
        ],
    )  # fmt: skip


def test_the_rollout_sample_filter_takes_samples_out_of_the_loss_only():
    cfg = make_cfg(
        "--custom-rm-path", f"{MILES}.length_rm",
        "--rollout-sample-filter-path", f"{MILES}.sample_filter",
    )  # fmt: skip
    train, evaluation = score(cfg, _tokens_group("t"), _tokens_group("e", eval_=True))
    assert train.verdict == Verdict.VERDICT_KEPT and rewards(train) == [1.0, 2.0, 3.0]
    assert [list(s.loss_mask) for s in train.group.samples] == [[0], [1, 1], [1, 1, 1]]
    assert [list(s.loss_mask) for s in evaluation.group.samples] == [[1], [1, 1], [1, 1, 1]]


def test_a_raising_sample_filter_fails_the_group_naming_it():
    cfg = make_cfg(
        "--custom-rm-path", f"{MILES}.length_rm",
        "--rollout-sample-filter-path", f"{MILES}.custom_rm",  # wrong arguments: it raises
    )  # fmt: skip
    [out] = score(cfg, _tokens_group())
    assert out.verdict == Verdict.VERDICT_FAILED
    assert out.reason.startswith(f"reward: --rollout-sample-filter-path {MILES}.custom_rm raised")
    assert out.plugin_error.flag == "--rollout-sample-filter-path"


class CharTokenizer:
    """What PluginDataSource asks of a tokenizer: one id per character."""

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": ([1] if add_special_tokens else []) + [ord(c) for c in text]}

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


def _data_source_cfg(tmp_path):
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"q": f"{i}+{i}=", "a": str(2 * i)}) + "\n"
                            for i in range(5)))  # fmt: skip
    return make_cfg("--prompt-data", str(data), "--input-key", "q", "--label-key", "a",
                    "--n-samples-per-prompt", "2", "--run-dir", str(tmp_path),
                    "--data-source-path", f"{MILES}.JsonlDataSource")  # fmt: skip


def test_a_miles_data_source_feeds_admission_and_resumes_where_it_saved(tmp_path):
    from millstream.trainer.data import PluginDataSource

    cfg = _data_source_cfg(tmp_path)
    source = PluginDataSource(cfg.rollout.data_source_path, cfg, CharTokenizer())
    taken = source.take(3)
    assert [(row.data_index, epoch) for row, epoch in taken] == [(0, 0), (1, 0), (2, 0)]
    row = taken[1][0]
    assert (row.prompt_text, row.label, row.prompt_token_ids[:3]) == ("1+1=", "2", [1, 49, 43])
    assert row.metadata == {"drop": False, "row": 1, "group_index": 1}
    assert taken[2][0].metadata["drop"] is True
    source.release(0)  # terminal: only groups 1 and 2 stay for a resume
    state = json.loads(json.dumps(source.state_dict(rollout_id=4)))  # as trainer_state.json
    assert json.loads((tmp_path / "data_source_4.json").read_text())["offset"] == 3

    resumed = PluginDataSource(cfg.rollout.data_source_path, cfg, CharTokenizer())
    resumed.load_state_dict(state)
    assert resumed.row(2) == taken[2][0] and sorted(resumed.rows) == [1, 2]
    [(next_row, _)] = resumed.take(1)
    assert (next_row.data_index, next_row.prompt_text) == (3, "3+3=")  # the plugin's offset too


def test_a_data_source_that_returns_too_few_groups_is_named(tmp_path):
    from millstream.trainer.data import PluginDataSource

    cfg = _data_source_cfg(tmp_path)
    source = PluginDataSource(cfg.rollout.data_source_path, cfg, CharTokenizer())
    source.plugin.get_samples = lambda n: []
    with pytest.raises(MillstreamError, match=r"get_samples\(2\) returned 0 groups"):
        source.take(2)
    source.plugin.get_samples = lambda n: 1 / 0
    with pytest.raises(MillstreamError, match=r"get_samples\(1\) raised ZeroDivisionError"):
        source.take(1)


def test_a_per_sample_generate_gets_the_workers_router_in_miles_args():
    from millstream.rollout.miles_generate import MilesGenerate

    cfg = make_cfg("--custom-generate-function-path", f"{MILES}.generate")
    rollout = MilesGenerate(
        cfg.rollout.custom_generate_function_path, cfg, "http://10.0.0.5:31000/"
    )
    assert (rollout.args.sglang_router_ip, rollout.args.sglang_router_port) == ("10.0.0.5", 31000)
    assert rollout.args.custom_generate_function_path.endswith(".generate")
    import miles.utils.http_utils

    from millstream.compat.miles import http_post

    assert miles.utils.http_utils.post is http_post


def test_miles_post_tries_again_after_an_http_error_as_miles_does():
    """A router answers 503 while the engines take new weights: Miles' post waits a second
    and asks again (any failure, up to max_retries), so a plugin never sees it."""
    import http.server
    import threading

    from millstream.compat import miles

    answers = [503, 200]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["content-length"]))
            status = answers.pop(0)
            body = b'{"text": "ok"}' if status == 200 else b"no engine at this version"
            self.send_response(status)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/generate"

    async def post(max_retries: int):
        try:
            return await miles.http_post(url, {"text": "1+1="}, max_retries=max_retries)
        finally:
            await miles.http_utils.aclose()

    try:
        assert asyncio.run(post(3)) == {"text": "ok"} and answers == []
        answers[:] = [503, 503]
        with pytest.raises(httpx.HTTPStatusError):
            asyncio.run(post(2))
    finally:
        server.shutdown()
        server.server_close()
