"""Miles' modules stood in for (compat/miles/): each Miles name is our module, refused names
say why, and the stand-ins behave as Miles' do (Sample, SingletonMeta, labels on the wire,
GenerateState, generate against an HTTP server, the default data source, loss masks)."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from millstream.common.config import parse_run_config
from millstream.common.types import PromptGroup
from millstream.common.types import Sample as PbSample
from millstream.compat.miles import (
    MILES_MODULES,
    RewardSpec,
    Sample,
    install_miles_modules,
    make_args,
    sample_from_pb,
    sample_to_pb,
)
from millstream.compat.miles.importer import REFUSED

install_miles_modules()


def make_cfg(*flags: str):
    return parse_run_config(["--run-id", "t", "--rollout-batch-size", "2", *flags], mode="async")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from tests.support.tiny_model import build_tokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(path)
    return path


@pytest.fixture
def fresh_state():
    from millstream.compat.miles.misc import SingletonMeta

    SingletonMeta.clear_all_instances()
    yield
    SingletonMeta.clear_all_instances()


# -- names ---------------------------------------------------------------------------------


@pytest.mark.parametrize("miles_name", sorted(MILES_MODULES))
def test_each_miles_module_is_ours(miles_name):
    assert importlib.import_module(miles_name) is importlib.import_module(MILES_MODULES[miles_name])
    assert sys.modules[miles_name].__spec__.name == MILES_MODULES[miles_name]


# What Miles' examples/ and miles/rollout/ plugins import (and what we have of it).
EXAMPLE_IMPORTS = [
    ("miles.utils.types", "Sample"),
    ("miles.utils.http_utils", "post"),
    ("miles.utils.http_utils", "get"),
    ("miles.utils.http_utils", "wait_http_ok"),
    ("miles.utils.misc", "load_function"),
    ("miles.utils.misc", "get_free_port"),
    ("miles.utils.misc", "SingletonMeta"),
    ("miles.utils.async_utils", "run"),
    ("miles.utils.processing_utils", "load_tokenizer"),
    ("miles.utils.processing_utils", "encode_image_for_rollout_engine"),
    ("miles.utils.data", "Dataset"),
    ("miles.utils.mask_utils", "MultiTurnLossMaskGenerator"),
    ("miles.rollout.sglang_rollout", "GenerateState"),
    ("miles.rollout.sglang_rollout", "generate"),
    ("miles.rollout.sglang_rollout", "generate_rollout"),
    ("miles.rollout.filter_hub.base_types", "MetricGatherer"),
    ("miles.rollout.filter_hub.base_types", "call_dynamic_filter"),
    ("miles.rollout.data_source", "DataSource"),
    ("miles.rollout.base_types", "RolloutFnTrainOutput"),
    ("miles.rollout.base_types", "GenerateFnInput"),
    ("miles.backends.training_utils.cp_utils", "all_gather_with_cp"),  # mis.py, in its body
    ("miles.backends.training_utils.cp_utils", "slice_log_prob_with_cp"),
]


def test_what_miles_examples_import_is_there():
    missing = [f"{m}.{n}" for m, n in EXAMPLE_IMPORTS if not hasattr(importlib.import_module(m), n)]
    assert not missing
    from miles.utils import misc  # a submodule through its stand-in package

    assert misc is importlib.import_module("millstream.compat.miles.misc")


def test_installing_and_importing_the_light_stand_ins_loads_no_torch():
    code = (
        "import sys; from millstream.compat.miles import install_miles_modules as i; i(); "
        "import miles.utils.types, miles.utils.misc, miles.rollout.sglang_rollout, "
        "miles.rollout.data_source, miles.utils.mask_utils, miles.utils.data; "
        "sys.exit(', '.join(sorted({'torch', 'transformers', 'numpy'} & set(sys.modules))) or None)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("miles.ray.rollout_manager", "Ray actors"),
        ("miles.backends.training_utils.loss_hub", "Megatron.*stands in for .*cp_utils only"),
        ("miles.utils.external_utils.command_utils", "launch tooling"),
        ("miles.utils.lora", "LoRA"),
        ("miles.rollout.inference_rollout.inference_rollout_common", "whole-batch"),
        ("miles.utils.timer", "stands in for these Miles modules: .*miles.rollout.base_types"),
    ],
)
def test_a_module_not_stood_in_for_says_why(name, reason):
    with pytest.raises(ModuleNotFoundError, match=reason) as info:
        importlib.import_module(name)
    assert info.value.name in REFUSED or info.value.name == name
    assert repr(info.value.name) in str(info.value)


def test_from_a_stand_in_package_import_a_refused_module_says_why():
    with pytest.raises(ModuleNotFoundError, match="debugging"):
        from miles.utils import dumper_utils  # noqa: F401


# -- Sample --------------------------------------------------------------------------------

MILES_FIELDS = [
    "group_index",
    "index",
    "rollout_id",
    "prompt",
    "tokens",
    "multimodal_inputs",
    "multimodal_train_inputs",
    "response",
    "response_length",
    "label",
    "reward",
    "loss_mask",
    "weight_versions",
    "rollout_log_probs",
    "rollout_routed_experts",
    "rollout_indexer_topk",
    "remove_sample",
    "teacher_log_probs",
    "opd_reverse_kl",
    "status",
    "metadata",
    "generate_function_path",
    "train_metadata",
    "adapter",
    "reward_spec",
    "routing_key",
    "non_generation_time",
    "spec_info",
    "prefix_cache_info",
]


def test_sample_has_miles_fields_in_miles_order_then_ours():
    names = [f.name for f in dataclasses.fields(Sample)]
    assert names == [*MILES_FIELDS, "group_id", "finish_reason", "failure_reason"]
    assert [s.value for s in Sample.Status] == [
        "pending", "completed", "truncated", "aborted", "failed"
    ]  # fmt: skip


def test_sample_validate_names_the_field_that_disagrees():
    sample = Sample(tokens=[1, 2, 3, 4], response_length=2, loss_mask=[1, 1])
    sample.validate()
    sample.rollout_log_probs = [-0.1]
    with pytest.raises(AssertionError, match=r"rollout_log_probs length \(1\) != response_length"):
        sample.validate()


def test_sample_to_dict_and_back_keeps_everything():
    sample = Sample(
        index=3, tokens=[1, 2, 3], response="ab", response_length=2, label={"answer": 4},
        status=Sample.Status.TRUNCATED, reward_spec=RewardSpec(rm_type="math"),
        weight_versions=["2", "3"], group_id="g",
    )  # fmt: skip
    sample.spec_info.add({"spec_accept_token_num": 3, "spec_draft_token_num": 4})
    sample.prefix_cache_info.add({"cached_tokens": 1, "prompt_tokens": 2})
    sample.extra = "kept"  # Miles' from_dict keeps unknown keys as attributes
    data = sample.to_dict()
    assert data["status"] == "truncated" and data["spec_info"]["spec_draft_token_num"] == 4
    back = Sample.from_dict(json.loads(json.dumps(data, default=dataclasses.asdict)))
    assert back == sample and back.extra == "kept"
    assert back.spec_info.spec_accept_rate == 0.75
    assert back.prefix_cache_info.prefix_cache_hit_rate == 0.5


def test_sample_strip_retry_versions_and_meta_info():
    class Decoder:
        def decode(self, ids):
            return "".join(chr(96 + i) for i in ids)

    sample = Sample(tokens=[9, 1, 2, 3], response_length=3, loss_mask=[1, 1, 1],
                    rollout_log_probs=[-1.0, -2.0, -3.0], weight_versions=["4", "2", "x"])  # fmt: skip
    sample.strip_last_output_tokens(1, Decoder())
    assert (sample.tokens, sample.response, sample.loss_mask) == ([9, 1, 2], "ab", [1, 1])
    assert sample.rollout_log_probs == [-1.0, -2.0] and sample.oldest_weight_version == 2
    sample.update_from_meta_info(
        make_args(make_cfg()), {"finish_reason": {"type": "length"}, "weight_version": "5"}
    )
    assert sample.status == Sample.Status.TRUNCATED and sample.weight_versions[-1] == "5"
    assert sample.finish_reason == "length"
    sample.reset_for_retry()
    assert sample.tokens == [] and sample.status == Sample.Status.ABORTED
    assert sample.rollout_log_probs is None and sample.weight_versions == []


def test_singleton_meta_keeps_the_first_instance_until_cleared():
    from miles.utils.misc import SingletonMeta

    class State(metaclass=SingletonMeta):
        def __init__(self, value):
            self.value = value

    assert State(1) is State(2) and State(3).value == 1
    SingletonMeta.clear(State)
    assert State(4).value == 4
    SingletonMeta.clear_all_instances()
    assert State(5).value == 5


# -- labels on the wire --------------------------------------------------------------------


@pytest.mark.parametrize("label", [{"answer": 4, "unit": "cm"}, [1, 2], 7, 2.5, True, "42", None])
def test_a_label_keeps_its_json_type_through_the_wire(label):
    pb = sample_to_pb(Sample(tokens=[1, 2], response_length=1, label=label))
    if isinstance(label, str) or label is None:
        assert (pb.label, pb.label_json) == (label or "", "")
    else:
        assert pb.label == pb.label_json == json.dumps(label)
    assert sample_from_pb(pb).label == (label if label is not None else "")


def test_a_wire_sample_without_json_takes_its_groups():
    group = PromptGroup(label='{"a": 1}', label_json='{"a": 1}')
    pb = PbSample(label=group.label)
    assert sample_from_pb(pb, label_json=group.label_json).label == {"a": 1}
    other = PbSample(label="changed by a plugin")
    assert sample_from_pb(other, label_json=group.label_json).label == "changed by a plugin"


# -- utilities -----------------------------------------------------------------------------


def test_load_function_run_and_filters():
    from miles.rollout.filter_hub.base_types import (
        DynamicFilterOutput,
        MetricGatherer,
        call_dynamic_filter,
    )
    from miles.utils.async_utils import run
    from miles.utils.misc import function_registry, load_function

    assert load_function(None) is None
    assert load_function("miles.utils.async_utils.run") is run
    with function_registry.temporary("made.on.the_fly", len):
        assert load_function("made.on.the_fly", sync_required=True) is len
    with pytest.raises(ValueError, match="synchronous"):
        load_function("miles.utils.http_utils.post", sync_required=True)

    async def twice(x):
        return 2 * x

    assert run(twice(21)) == 42
    assert call_dynamic_filter(None) == DynamicFilterOutput(keep=True)
    assert call_dynamic_filter(lambda *a: False) == DynamicFilterOutput(keep=False)
    gatherer = MetricGatherer()
    for reason in ("zero_std", "zero_std", None):
        gatherer.on_dynamic_filter_drop(reason)
    assert gatherer.collect() == {"rollout/dynamic_filter/drop_zero_std": 2}


# -- GenerateState and generate ------------------------------------------------------------


def test_generate_state_builds_miles_sampling_params(tokenizer_dir, fresh_state):
    from miles.rollout.sglang_rollout import GenerateState

    args = make_args(make_cfg(
        "--hf-checkpoint", str(tokenizer_dir), "--rollout-temperature", "0.7",
        "--rollout-top-k", "5", "--rollout-max-response-len", "16", "--rollout-stop", "</s>",
        "--sglang-server-concurrency", "8", "--rollout-num-engines", "3",
    ))  # fmt: skip
    state = GenerateState(args)
    assert state.sampling_params == {
        "temperature": 0.7, "top_p": 1.0, "top_k": 5, "max_new_tokens": 16, "stop": ["</s>"],
        "stop_token_ids": None, "skip_special_tokens": False, "no_stop_trim": True,
        "spaces_between_special_tokens": False,
    }  # fmt: skip
    assert state.semaphore._value == 24 and state.processor is None
    assert state.tokenizer.encode("hi", add_special_tokens=False) == [71, 72]
    assert GenerateState(None) is state
    with state.dp_rank_context() as rank:
        assert rank == 0 and state.dp_counts == [1]


class _Engine(BaseHTTPRequestHandler):
    """SGLang's /generate: two tokens with their logprobs, finish `length`."""

    bodies: list = []  # noqa: RUF012

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        self.bodies.append(body)
        answer = {
            "text": "xy",
            "meta_info": {
                "finish_reason": {"type": "length", "length": 2},
                "weight_version": "3",
                "prompt_tokens": len(body["input_ids"]),
                "cached_tokens": 1,
                "output_token_logprobs": [[-0.5, 120, None], [-0.25, 121, None]],
            },
        }
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_generate_posts_tokens_and_fills_the_sample_as_miles_does(tokenizer_dir, fresh_state):
    from miles.rollout.sglang_rollout import GenerateState, generate

    from millstream.compat.miles import http_utils

    server = ThreadingHTTPServer(("127.0.0.1", 0), _Engine)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    args = make_args(make_cfg("--hf-checkpoint", str(tokenizer_dir)))
    values = args.to_dict() | {"sglang_router_ip": "127.0.0.1",
                               "sglang_router_port": server.server_address[1]}  # fmt: skip
    args = type(args)(values)

    async def main():
        try:
            params = GenerateState(args).sampling_params.copy()
            fresh = await generate(args, Sample(prompt="hi"), dict(params))
            params["max_new_tokens"] = 3
            go_on = Sample(prompt="hi", tokens=[71, 72, 5], response="e", response_length=1,
                           loss_mask=[0], rollout_log_probs=[-1.0], status=Sample.Status.ABORTED)  # fmt: skip
            resumed = await generate(args, go_on, params)
            return fresh, resumed
        finally:
            await http_utils.aclose()

    try:
        fresh, resumed = asyncio.run(main())
    finally:
        server.shutdown()
        server.server_close()
    first, second = _Engine.bodies[-2:]
    assert first["input_ids"] == [71, 72] and first["return_logprob"] is True
    assert first["sampling_params"]["no_stop_trim"] is True
    assert fresh.tokens == [71, 72, 120, 121] and fresh.response == "xy"
    assert (fresh.response_length, fresh.rollout_log_probs) == (2, [-0.5, -0.25])
    assert fresh.status == Sample.Status.TRUNCATED and fresh.weight_versions == ["3"]
    assert fresh.loss_mask is None and fresh.prefix_cache_info.cached_tokens == 1
    fresh.validate()
    # a partial sample goes on from its tokens, with what it has taken off the budget
    assert second["input_ids"] == [71, 72, 5] and second["sampling_params"]["max_new_tokens"] == 2
    assert resumed.loss_mask == [0, 1, 1] and resumed.rollout_log_probs == [-1.0, -0.5, -0.25]
    assert resumed.response == "exy" and resumed.tokens == [71, 72, 5, 120, 121]


def test_whole_batch_generate_rollout_is_refused_with_what_to_write():
    from miles.rollout.sglang_rollout import generate_rollout

    from millstream.compat.miles import PluginSignatureError

    with pytest.raises(PluginSignatureError, match="per-group form"):
        generate_rollout(None, 0, None)


# -- the default data source and loss masks ------------------------------------------------


def test_miles_default_data_source_feeds_admission_templated_once(tokenizer_dir, tmp_path):
    from millstream.trainer.data import PluginDataSource

    data = tmp_path / "prompts.jsonl"
    rows = [{"q": f"{i}+{i}=", "a": {"sum": 2 * i}} for i in range(3)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = make_cfg(
        "--prompt-data", str(data), "--input-key", "q", "--label-key", "a",
        "--hf-checkpoint", str(tokenizer_dir), "--apply-chat-template",
        "--n-samples-per-prompt", "2", "--save", str(tmp_path / "ckpt"),
        "--data-source-path", "miles.rollout.data_source.RolloutDataSourceWithBuffer",
    )  # fmt: skip
    tokenizer = importlib.import_module("miles.utils.processing_utils").load_tokenizer(
        str(tokenizer_dir)
    )
    source = PluginDataSource(
        cfg.rollout.data_source_path, cfg, tokenizer, apply_chat_template=True
    )
    plugin = source.plugin
    groups = plugin.get_samples(2)
    assert [[s.index for s in g] for g in groups] == [[0, 1], [2, 3]]
    assert [g[0].group_index for g in groups] == [0, 1] and groups[1][0].label == {"sum": 2}
    [(row, _)] = source.take(1)  # the third prompt
    assert row.prompt_text == "<|im_start|>user\n2+2=<|im_end|>\n<|im_start|>assistant\n"
    plugin.save(7)
    assert plugin.get_samples(1)[0][0].prompt.count("0+0=") == 1  # the next epoch
    plugin.load(7)
    assert (plugin.sample_offset, plugin.epoch_id, plugin.sample_index) == (3, 0, 6)
    plugin.add_samples([groups[0]])
    assert plugin.get_buffer_length() == 1 and plugin.get_samples(1) == [groups[0]]


def test_loss_mask_marks_the_assistant_turns_of_a_chatml_conversation(tokenizer_dir):
    from miles.utils.mask_utils import MultiTurnLossMaskGenerator
    from miles.utils.processing_utils import load_tokenizer

    tokenizer = load_tokenizer(str(tokenizer_dir))
    masks = MultiTurnLossMaskGenerator(tokenizer, tokenizer_type="qwen")
    assert (masks.system_message_length, masks.gen_token_length) == (0, 11)
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "1+1="},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "2+2="},
        {"role": "assistant", "content": "4", "step_loss_mask": 0},
    ]
    ids, mask = masks.get_loss_mask(messages)
    assert ids == tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    assert masks.get_text_from_loss_mask(ids, mask) == ["2<|im_end|>\n"]
    assert masks.get_response_lengths([mask]) == [len(mask) - mask.index(1)]


def test_miles_metric_utils_give_miles_values():
    from miles.utils.metric_utils import compute_pass_rate, compute_statistics, has_repetition

    # 3 groups of 4: 0, 1 and 4 right (Miles' unbiased pass@k, by hand)
    rewards = [0, 0, 0, 0, 1, 0, 0, 0, 1, 1, 1, 1]  # by group
    got = compute_pass_rate(rewards, 4)
    assert got == pytest.approx({"pass@1": (0 + 0.25 + 1) / 3, "pass@2": (0 + 0.5 + 1) / 3,
                                 "pass@4": (0 + 1 + 1) / 3})  # fmt: skip
    assert compute_pass_rate([1.0], 1) == {}
    assert compute_statistics([3, 1, 2, 10]) == {"mean": 4.0, "median": 2.5, "max": 10.0,
                                                 "min": 1.0}  # fmt: skip
    assert has_repetition("ab" * 6000) and not has_repetition("ab" * 100)


def test_tracking_log_outside_a_log_function_goes_nowhere_and_inside_is_collected():
    from miles.utils.tracking_utils import tracking

    tracking.log(None, {"rollout/x": 1.0, "rollout/step": 0}, step_key="rollout/step")
    with tracking.collect() as outer:
        tracking.log(None, {"a": 1.0}, step_key="rollout/step")
        with tracking.collect() as inner:
            tracking.log(None, {"b": 2.0, "rollout/step": 1}, step_key="rollout/step")
    assert outer == {"a": 1.0} and inner == {"b": 2.0}
