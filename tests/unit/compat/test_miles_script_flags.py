"""Miles flags that common launch scripts carry (issue 34): each does here what it does in
Miles, or is refused by name (keep-old-actor, multimodal-keys: test_flags_consumed.py runs
every refusal). And the `args` fields Miles' plugins read are there."""

from __future__ import annotations

import json
import math

import pytest

from millstream.common.config import ConfigError, checks, foreign, parse_run_config
from millstream.common.types import PromptGroup, Sample, SampleGroup, SampleStatus, ScoredGroup
from millstream.compat.miles import make_args
from millstream.launch import engines
from millstream.rollout.config import plan_for
from millstream.trainer import build
from millstream.trainer.data import EmptyPrompts, PluginDataSource
from millstream.trainer.observe.metrics import MetricsLogger, pass_at_k


def _cfg(*flags: str):
    return parse_run_config(["--rollout-batch-size", "2", "--n-samples-per-prompt", "4", *flags])


def _run(tiny_model_dir, tmp_path, *flags: str):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"input": "hi"}) + "\n")
    return _cfg("--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(prompts),
                "--rm-type", "math", "--num-rollout", "1", *flags)  # fmt: skip


def test_the_args_miles_plugins_read_are_there():
    args = make_args(_cfg("--sglang-dp-size", "4", "--rollout-stop-token-ids", "7", "8"))
    assert args.sglang_dp_size == 4 and args.rollout_stop_token_ids == (7, 8)
    assert args.sglang_server_concurrency == 512 and args.rollout_global_dataset is True
    assert args.chat_template_path is None and args.apply_chat_template_kwargs == {}
    assert args.multimodal_keys is None and args.log_passrate is False
    assert args.tis_clip == 2.0 and args.use_rollout_logprobs is False
    assert make_args(_cfg()).sglang_dp_size == 1
    assert _cfg("--sglang-dp-size=2").sglang.sglang_server_args == ["--sglang-dp-size=2"]


def test_chat_template_path_and_kwargs_format_the_prompts(tiny_model_dir, tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text(
        "{% if shout %}LOUD {% endif %}{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    )
    cfg = _run(tiny_model_dir, tmp_path, "--apply-chat-template", "--chat-template-path",
               str(template), "--apply-chat-template-kwargs", '{"shout": true}')  # fmt: skip
    assert cfg.rollout.apply_chat_template_kwargs == {"shout": True}
    tokenizer = build.load_tokenizer(cfg)
    train, _ = build.data_sources(cfg, tokenizer)
    ((row, _),) = train.take(1)
    assert row.prompt_text == "LOUD [hi]"


def test_rollout_max_context_len_caps_prompt_and_response(tmp_path):
    cfg = _cfg("--rollout-max-context-len", "10", "--rollout-max-response-len", "8")
    assert (cfg.rollout.rollout_max_prompt_len, cfg.eval.eval_max_prompt_len) == (9, 9)
    for prompt, room in ((3, 7), (1, 8), (9, 1), (12, 0)):
        group = PromptGroup(group_id="g", prompt_token_ids=[5] * prompt)
        assert plan_for(group, cfg).max_new_tokens == room
    assert (
        _cfg(
            "--rollout-max-context-len", "10", "--rollout-max-prompt-len", "4"
        ).rollout.rollout_max_prompt_len
        == 4
    )
    with pytest.raises(SystemExit):
        _cfg("--rollout-max-context-len", "10", "--eval-max-prompt-len", "10")


def test_eval_min_new_tokens_goes_to_eval_requests_and_needs_sglang():
    cfg = _cfg("--eval-min-new-tokens", "5")
    eval_group = PromptGroup(group_id="e", prompt_token_ids=[1], is_eval=True, eval_name="x")
    assert plan_for(eval_group, cfg).sampling_params["min_new_tokens"] == 5
    assert "min_new_tokens" not in plan_for(PromptGroup(group_id="t"), cfg).sampling_params
    engines.check(cfg, sglang=True)
    with pytest.raises(ConfigError, match=r"^--eval-min-new-tokens 5: SGLang is not installed"):
        engines.check(cfg, sglang=False)


def test_without_the_global_dataset_groups_start_empty(tiny_model_dir, tmp_path):
    flags = ("--disable-rollout-global-dataset",)
    with pytest.raises(ConfigError, match=r"^--disable-rollout-global-dataset: the trainer"):
        checks._check_required(_run(tiny_model_dir, tmp_path, *flags))
    cfg = _run(tiny_model_dir, tmp_path, *flags, "--custom-generate-function-path", "m.gen")
    checks._check_required(cfg)
    assert make_args(cfg).rollout_global_dataset is False
    train, _ = build.data_sources(cfg, build.load_tokenizer(cfg))
    assert isinstance(train, PluginDataSource) and isinstance(train.plugin, EmptyPrompts)
    rows = [row for row, _ in train.take(2)]
    assert [(r.prompt_text, r.prompt_token_ids, r.label) for r in rows] == [("", [], "")] * 2
    with pytest.raises(SystemExit):  # Miles' store_false flag takes no value
        _cfg("--disable-rollout-global-dataset", "1")


def test_pass_at_k_is_the_unbiased_estimate():
    # groups of 4 with 0, 1 and 4 passing samples (reward 1; 0.5 does not pass)
    rewards = [0, 0, 0.5, 0, 1, 0, 0, 0, 1, 1, 1, 1]
    got = pass_at_k(rewards, 4)
    by_hand = {
        k: sum(1 - math.comb(4 - c, k) / math.comb(4, k) for c in (0, 1, 4)) / 3 for k in (1, 2, 4)
    }
    assert got == {f"pass@{k}": pytest.approx(v, rel=1e-12) for k, v in by_hand.items()}
    assert pass_at_k([1.0, 0.0], 1) == {}


def _groups() -> list[ScoredGroup]:
    return [
        ScoredGroup(group=SampleGroup(prompt=PromptGroup(group_id=f"g{g}"), samples=[
            Sample(group_id=f"g{g}", index=i, reward=float(i < g),
                   status=SampleStatus.SAMPLE_STATUS_COMPLETED)
            for i in range(4)
        ]))
        for g in (1, 3)
    ]  # fmt: skip


def test_log_passrate_puts_pass_at_k_in_the_row_and_the_eval(tmp_path):
    logger = MetricsLogger(_cfg("--log-passrate", "--n-samples-per-eval-prompt", "2"), tmp_path)
    logger.log(1, {"loss": 0.5}, groups=_groups())
    extra = logger.log_eval(1, {"eval/x": 0.5}, {"x": {"rewards": [1.0, 0.0, 0.0, 0.0]}})
    logger.close()
    (row,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert row["passrate/pass@1"] == pytest.approx(0.5)  # (1 + 3) / 8
    assert row["passrate/pass@4"] == pytest.approx(1.0)
    assert extra == {"eval/x-pass@1": pytest.approx(0.25), "eval/x-pass@2": pytest.approx(0.5)}
    quiet = MetricsLogger(_cfg(), tmp_path / "quiet")
    quiet.log(1, {"loss": 0.5}, groups=_groups())
    quiet.close()
    assert "passrate/pass@1" not in (tmp_path / "quiet" / "metrics.jsonl").read_text()


def test_miles_default_rollout_and_server_concurrency_from_scripts_are_taken(
    tiny_model_dir, tmp_path
):
    """Miles' scripts often write out its default rollout and --sglang-server-concurrency
    1024: the first is the rollout the workers run anyway, the second sizes GenerateState's
    semaphore for plugins."""
    cfg = _run(tiny_model_dir, tmp_path,
               "--rollout-function-path", "miles.rollout.sglang_rollout.generate_rollout",
               "--eval-function-path", "miles.rollout.sglang_rollout.generate_rollout",
               "--sglang-server-concurrency", "1024")  # fmt: skip
    assert cfg.rollout.rollout_function_path is None and cfg.rollout.eval_function_path is None
    assert make_args(cfg).sglang_server_concurrency == 1024
    checks.check(cfg)


def test_args_answers_miles_flags_millstream_refuses_or_hands_to_sglang():
    """Miles' default log function reads `args.load_debug_rollout_data`,
    `args.log_reward_category` and `args.sglang_speculative_algorithm`: a refused Miles flag
    reads None (off, as its Miles default: a run given it was refused), a --sglang-X flag its
    value as given (None when not); any other unknown name is still an AttributeError."""
    args = make_args(_cfg("--sglang-speculative-algorithm", "EAGLE", "--sglang-enable-metrics",
                          "--sglang-cuda-graph-bs", "1", "2", "--sglang-dp-size=2"))  # fmt: skip
    assert args.load_debug_rollout_data is None and args.log_reward_category is None
    assert args.lora_rank is None  # a refused family (--lora-*)
    assert args.sglang_speculative_algorithm == "EAGLE" and args.sglang_enable_metrics is True
    assert args.sglang_cuda_graph_bs == ["1", "2"] and args.sglang_chunked_prefill_size is None
    with pytest.raises(AttributeError, match="no such flag here"):
        _ = args.no_such_thing
    with pytest.raises(SystemExit):  # refused by name, as every foreign flag
        _cfg("--log-reward-category", "difficulty")
    assert "dict reward" in foreign.why_not("--log-reward-category")
