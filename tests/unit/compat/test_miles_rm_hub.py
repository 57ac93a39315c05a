"""Miles' `miles.rollout.rm_hub` (compat/miles/rm_hub/): the graders are the built-ins' own, and
`async_rm` / `batched_async_rm` dispatch on Miles' Samples as Miles does (issue 34)."""

from __future__ import annotations

import asyncio
import importlib

import pytest

from millstream.compat.miles import Args, RewardSpec, Sample, install_miles_modules
from millstream.compat.miles import rm_hub as hub
from millstream.compat.miles.misc import function_registry
from millstream.compat.miles.rm_hub import deepscaler, f1, math_dapo_utils, math_utils
from millstream.reward import rm_hub as builtins


def test_the_builtins_call_the_graders_plugins_import():
    assert builtins.grade_answer_verl is math_utils.grade_answer_verl is hub.grade_answer_verl
    assert builtins.miles_boxed is math_utils.extract_answer is hub.extract_boxed_answer
    assert builtins.compute_score is math_dapo_utils.compute_score is hub.compute_score_dapo
    assert builtins.get_deepscaler_rule_based_reward is deepscaler.get_deepscaler_rule_based_reward
    assert builtins.f1_score is f1.f1_score is hub.f1_score


def test_miles_names_import_the_same_modules():
    assert install_miles_modules()
    assert importlib.import_module("miles.rollout.rm_hub") is hub
    miles_math = importlib.import_module("miles.rollout.rm_hub.math_utils")
    assert miles_math.grade_answer_verl is builtins.grade_answer_verl
    miles_dapo = importlib.import_module("miles.rollout.rm_hub.math_dapo_utils")
    assert miles_dapo.compute_score is builtins.compute_score


def run(coro):
    return asyncio.run(coro)


def args(**flags) -> Args:
    return Args({"rm_type": None, "custom_rm_path": None, **flags})


def sample(response: str, label, **fields) -> Sample:
    return Sample(response=response, label=label, **fields)


@pytest.mark.parametrize(
    ("rm_type", "response", "label", "reward"),
    [
        ("math", "so \\boxed{\\frac{1}{2}}", "0.5", 1),
        ("math", "so \\boxed{42}", 42, 1),  # a number label is read as its text
        ("math", "so \\boxed{0}", 0, 0),  # Miles: `if not ground_truth` -> False
        ("math", "Total: 12", "12", 0),  # no box
        ("deepscaler", "<think>x</think> \\boxed{7}", "7", 1),
        ("deepscaler", "<think>x</think> \\boxed{7}", 7, 1),
        ("deepscaler", "\\boxed{7}", "7", 0),  # no </think>, no ###Response
        ("gemma_math", "think<channel|>\\boxed{3}", "3", 1),
        ("f1", "Eiffel Tower", "the eiffel tower", 1.0),
        ("boxed_f1", "I say \\boxed{Paris}", "Paris", 1.0),
        ("gpqa", "The answer is B", "B", 1.0),
        ("gpqa", "The answer is B", 2, 0.0),  # index 2 is C
    ],
)
def test_async_rm_dispatches_like_miles(rm_type, response, label, reward):
    assert run(hub.async_rm(args(rm_type=rm_type), sample(response, label))) == reward


def test_dapo_gives_miles_dict():
    got = run(hub.async_rm(args(rm_type="dapo"), sample("Answer: 42", 42)))
    assert got == {"score": 1.0, "acc": True, "pred": "42"}
    with pytest.raises(ValueError):  # dapo labels are integers
        run(hub.async_rm(args(rm_type="dapo"), sample("Answer: x", "\\frac{1}{2}")))


def test_rm_type_comes_from_spec_then_metadata_then_args():
    s = sample("Eiffel Tower in Paris", "Eiffel Tower", metadata={"rm_type": "f1"})
    assert run(hub.async_rm(args(rm_type="math"), s)) == pytest.approx(2 / 3)
    s.reward_spec = RewardSpec(rm_type="math")
    assert run(hub.async_rm(args(rm_type="f1"), s)) == 0
    with pytest.raises(NotImplementedError, match="nope"):
        run(hub.async_rm(args(rm_type="nope"), sample("x", "y")))
    with pytest.raises(NotImplementedError, match="no rm_type"):
        run(hub.async_rm(args(), sample("x", "y")))


def test_custom_rm_gets_the_label_as_it_is():
    seen = []

    async def reward(a, s):
        seen.append(s.label)
        return 1.0 if s.response == s.label["answer"] else 0.0

    def group(a, samples):  # sync works too
        return [len(s.response) for s in samples]

    label = {"answer": "yes", "aliases": ["y"]}
    with function_registry.temporary("t.reward", reward), function_registry.temporary("t.g", group):
        assert run(hub.async_rm(args(custom_rm_path="t.reward"), sample("yes", label))) == 1.0
        assert seen == [label]
        assert run(hub.batched_async_rm(args(custom_rm_path="t.g"), [sample("ab", 1)])) == [2]


def test_batched_async_rm_scores_each_or_sets_rewards():
    samples = [sample("\\boxed{1}", "1"), sample("\\boxed{2}", "3")]
    assert run(hub.batched_async_rm(args(rm_type="math"), samples)) == [1, 0]
    assert run(hub.batched_async_rm(args(rm_type="math"), samples, True)) is None
    assert [s.reward for s in samples] == [1, 0]
    with pytest.raises(ValueError, match="already has reward"):
        run(hub.batched_async_rm(args(rm_type="math"), samples, inplace_set_reward_field=True))


def test_remote_rm_posts_the_label_as_its_value(monkeypatch):
    posted = []

    async def fake_post(url, payload, max_retries=60):
        posted.append((url, payload, max_retries))
        return {"score": 0.5}

    monkeypatch.setattr(hub, "post", fake_post)
    s = sample("resp", {"a": [1, 2]}, prompt="p")
    assert run(hub.async_rm(args(rm_type="remote_rm", rm_url="http://rm/x"), s)) == {"score": 0.5}
    assert posted == [
        ("http://rm/x", {"prompt": "p", "response": "resp", "label": {"a": [1, 2]}}, 1)
    ]


def test_miles_helpers_behave_as_miles():
    assert math_utils.last_boxed_only_string("a \\boxed{x} b \\fbox{y}") == "\\boxed{x}"
    assert math_utils.last_boxed_only_string("only \\fbox{y}") == "\\fbox{y}"
    assert math_utils.remove_boxed("\\fbox{y}") is None
    assert math_utils.extract_answer("\\fbox{5}") is None
    assert math_utils.grade_answer_mathd("\\frac12", "0.5")
    assert math_dapo_utils.normalize_final_answer("x = 1,000 cm") == "1000"
    assert math_dapo_utils.compute_score("\\boxed{7}", "7", strict_box_verify=True)["acc"]
    assert f1.f1_score(None, "x") == (0, 0, 0)
    assert f1.normalize_answer("The  Eiffel, Tower!") == "eiffel tower"


def test_the_reward_services_remote_rm_posts_the_label_as_its_value():
    import json

    import httpx

    from millstream.common.types import Sample as PbSample
    from millstream.reward.remote_rm import RemoteRM

    bodies = []

    def answer(request):
        bodies.append(json.loads(request.content))
        return httpx.Response(200, json=1.0)

    async def ask():
        rm = RemoteRM("http://rm/score", 5.0)
        rm._client = httpx.AsyncClient(transport=httpx.MockTransport(answer))
        try:
            for label, label_json in (('{"a": 1}', '{"a": 1}'), ("7", "7"), ("text", "")):
                await rm(PbSample(label=label, label_json=label_json), "p", "r")
        finally:
            await rm.aclose()

    run(ask())
    assert [b["label"] for b in bodies] == [{"a": 1}, 7, "text"]
