"""millstream's engine and SGLang on the same model and prompts: equal greedy tokens, and
log-probs within 1e-4 (both fp32; SGLang's CPU engine with its torch_native attention).
Measured here: ~2e-6 on the arith model's eval prompts."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.sglang_live.server import ARITH_MODEL, LiveSglang, eval_prompts
from tests.support.engine_proc import EngineProcess

pytestmark = pytest.mark.timeout(300)


def test_greedy_tokens_and_logprobs_equal_sglangs(sglang: LiveSglang, tmp_path: Path):
    prompts = eval_prompts(64)
    engine = EngineProcess(ARITH_MODEL, tmp_path)
    try:
        ours = LiveSglang.greedy_at(engine.url, prompts)
    finally:
        engine.stop()
    sglang.load_base()  # the tests before this one left their weights on it
    theirs = sglang.greedy(prompts)
    assert len(ours) == len(theirs) == 64
    worst = 0.0
    for p, a, b in zip(prompts, ours, theirs, strict=True):
        assert a["output_ids"] == b["output_ids"], (p, a["output_ids"], b["output_ids"])
        ours_lp = [lp for lp, _, _ in a["meta_info"]["output_token_logprobs"]]
        theirs_lp = [lp for lp, _, _ in b["meta_info"]["output_token_logprobs"]]
        worst = max([worst, *(abs(x - y) for x, y in zip(ours_lp, theirs_lp, strict=True))])
    print(f"\n64 prompts: the same greedy tokens; log-probs at most {worst:.2e} apart")
    assert worst < 1e-4
