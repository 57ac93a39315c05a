"""Every flag `millstream train` accepts is read, refused, or passed through (issue 14).

A flag nothing reads is a flag silently ignored: a Miles user would think it does what it does
in Miles. So every field of every RunConfig group must be read outside the config package
(found by walking services/ for the attribute), or sit in one of common/config/refusals.py's tables:
DERIVED (folded into a value that is read), REFUSED (a non-default value exits 2 before
anything starts), MATCHED (checked against the HF checkpoint's config.json), ACCEPTED
(nothing to do, said in --help), PASSED_THROUGH (handed on to real SGLang servers).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from millstream.common.config import (
    GROUPS,
    ConfigError,
    build_parser,
    checks,
    parse_run_config,
    refusals,
)
from millstream.common.config.schema import _unwrap
from millstream.trainer import main, preflight
from tests.support.tiny_job import arith_flags

REPO = Path(__file__).resolve().parents[3]
SERVICES = REPO / "services"
ARITH = REPO / "examples" / "arith"
# Checking a flag is not using it: the config package, preflight and the tables are not readers.
NOT_READERS = (SERVICES / "common" / "config", SERVICES / "trainer" / "preflight.py")
TABLES = {
    "DERIVED": refusals.DERIVED,
    "REFUSED": refusals.REFUSED,
    "MATCHED": refusals.MATCHED,
    "ACCEPTED": refusals.ACCEPTED,
    "PASSED_THROUGH": refusals.PASSED_THROUGH,
}
FIELDS = {f.name: (group, cls, f) for group, cls, _ in GROUPS for f in dataclasses.fields(cls)}


def _modules() -> list[tuple[set[str], set[str]]]:
    """(attribute names, plain names) of each module of services/ that may read the config."""
    out = []
    for path in sorted(SERVICES.rglob("*.py")):
        if any(path == p or p in path.parents for p in NOT_READERS):
            continue
        attrs, names = set(), set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute):
                attrs.add(node.attr)
            elif isinstance(node, ast.Name):
                names.add(node.id)
        out.append((attrs, names))
    return out


MODULES = _modules()


def _read(group: str, cls: type, attr: str) -> bool:
    """Some module reads `.attr` and also reaches the group (`cfg.<group>` or its class): the
    second half keeps HF's `config.hidden_size` from counting as MegatronConfig's."""
    return any(attr in a and (group in a or cls.__name__ in n) for a, n in MODULES)


def _flag(field: str) -> str:
    return refusals.flag_name(field)


def test_the_parser_accepts_exactly_the_groups_fields():
    parser = build_parser("millstream train")
    dests = {a.dest for a in parser._actions if a.option_strings and a.dest != "help"}
    # A derived field is no flag of its own (sglang_server_args: the --sglang-X given).
    assert dests == {n for n, (_, _, f) in FIELDS.items() if not f.metadata.get("derived")}
    assert len(FIELDS) == sum(len(dataclasses.fields(cls)) for _, cls, _ in GROUPS)  # unique


def test_every_flag_is_read_refused_or_passed_through():
    orphans = [
        f"{_flag(name)} (cfg.{group}.{name})"
        for name, (group, cls, _) in FIELDS.items()
        if not any(name in table for table in TABLES.values()) and not _read(group, cls, name)
    ]
    assert not orphans, (
        "nothing outside the config package reads these flags: make them do what they do in "
        "Miles, or add them to a table of millstream/common/config/refusals.py: "
        + ", ".join(orphans)
    )


def test_the_tables_name_real_flags_once_each():
    seen: dict[str, str] = {}
    for table_name, table in TABLES.items():
        for name in table:
            assert name in FIELDS, f"{table_name}: {name} is no flag"
            assert name not in seen, f"{name} is in {seen[name]} and {table_name}"
            seen[name] = table_name
    for name in refusals.PASSED_THROUGH:
        assert name.startswith("sglang_")


def test_a_flag_that_is_read_leaves_the_tables():
    """Refused, matched or accepted, but read: it does something now, so the table lies."""
    for table_name in ("REFUSED", "MATCHED", "ACCEPTED"):
        for name in TABLES[table_name]:
            group, cls, _ = FIELDS[name]
            assert not _read(group, cls, name), f"cfg.{group}.{name} is read: not {table_name}"


def test_flags_that_are_not_read_say_what_happens_in_their_help():
    for table_name in ("REFUSED", "MATCHED", "ACCEPTED", "PASSED_THROUGH"):
        for name in TABLES[table_name]:
            text = FIELDS[name][2].metadata["help"]
            assert text, f"{_flag(name)} ({table_name}) has no --help text"
            if table_name == "MATCHED":
                assert "config.json" in text, _flag(name)
            if table_name == "ACCEPTED":
                assert text.startswith("accepted"), _flag(name)
            if table_name == "PASSED_THROUGH":
                assert "passed to" in text, _flag(name)


# -- derived: the value each is folded into is read, and follows the flag ---------------------

DERIVED_EXAMPLES = {
    # field: (flags without it, the flags that set it)
    "global_batch_size": (["--n-samples-per-prompt", "2"], ["--global-batch-size", "4"]),
    "eval_prompt_data": ([], ["--eval-prompt-data", "dev", "dev.jsonl"]),
    "custom_tis_function_path": (
        [], ["--custom-tis-function-path", "miles.loss_hub.corrections.icepop_function"]
    ),
    "use_opd": (["--opd-teacher-url", "http://t:1"], ["--use-opd"]),
    "redis_password_file": ([], ["--redis-password-file", "{pw}"]),
    # base64:<YAML> (tis_level: token), Miles' inline form
    "custom_config_path": ([], ["--custom-config-path", "base64:dGlzX2xldmVsOiB0b2tlbgo="]),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(refusals.DERIVED))
def test_a_derived_flag_changes_a_value_that_is_read(tmp_path, name):
    group, cls, _ = FIELDS[name]
    target = refusals.DERIVED[name]
    assert _read(group, cls, target), f"nothing reads cfg.{group}.{target}"
    base, given = DERIVED_EXAMPLES[name]
    pw = tmp_path / "pw"
    pw.write_text("s3cret\n")
    given = [str(pw) if a == "{pw}" else a for a in given]

    def value(argv: list[str]):
        cfg = parse_run_config(["--rollout-batch-size", "4", *base, *argv])
        v = getattr(getattr(cfg, group), target)
        return v() if callable(v) else v

    assert value(given) != value([])


def test_every_derived_flag_has_an_example():
    assert set(DERIVED_EXAMPLES) == set(refusals.DERIVED)


# -- refused: a non-default value exits 2 before anything starts, naming the flag -------------


def _not_default(name: str) -> list[str]:
    """The flag with a value other than its default, as a command line gives it."""
    _, cls, f = FIELDS[name]
    tp, _ = _unwrap(typing.get_type_hints(cls)[name])
    if tp is bool:
        return [_flag(name)]
    if typing.get_origin(tp) is dict:
        return [_flag(name), '{"image": "image_file"}']
    if f.metadata.get("choices"):
        value = next(c for c in f.metadata["choices"] if c != f.default)
    elif tp is int:
        value = 2 if f.default != 2 else 3
    elif tp is float:
        value = 0.5 if f.default != 0.5 else 0.25
    else:
        value = "flash"
    return [_flag(name), str(value)]


def _exit_status(monkeypatch, argv: list[str]) -> int:
    """`millstream train ARGV` in this process, stopped before it would start anything."""

    def started(*_):
        raise AssertionError("preflight let the run start")

    for name in ("_apply_cpu_budget", "_run_trainer", "_run_data_parallel"):
        monkeypatch.setattr(main, name, started)
    try:
        return main.train(argv)
    except SystemExit as exit_info:  # argparse
        return int(exit_info.code or 0)


@pytest.mark.parametrize("name", list(refusals.REFUSED))
def test_each_refused_flag_exits_2_naming_it(monkeypatch, capsys, name):
    argv = arith_flags(*_not_default(name))
    assert _exit_status(monkeypatch, argv) == 2
    err = capsys.readouterr().err
    assert f"millstream train: error: {_flag(name)}" in err, err
    assert refusals.REFUSED[name] in err


def test_the_defaults_miles_scripts_spell_out_pass():
    """A Miles script sets many refused flags to the value that asks for nothing special."""
    spelled = [
        "--train-backend", "torch", "--tensor-model-parallel-size", "1",
        "--pipeline-model-parallel-size", "1", "--context-parallel-size", "1",
        "--expert-model-parallel-size", "1", "--expert-tensor-parallel-size", "1",
        "--attention-dropout", "0.0", "--hidden-dropout", "0", "--log-probs-chunk-size", "-1",
        "--rollout-num-gpus-per-engine", "1", "--sglang-server-concurrency", "512",
        "--accumulate-allreduce-grads-in-fp32", "--attention-softmax-in-fp32",
        "--seq-length", "4096", "--group-query-attention", "--no-offload-train",
        "--no-offload-rollout",
    ]  # fmt: skip
    cfg = parse_run_config(arith_flags(*spelled))
    assert refusals.refused(cfg) == {}
    preflight.check(cfg)


def test_a_refused_flag_exits_2_through_the_cli_before_anything_starts(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "millstream.cli", "train", *arith_flags("--attention-backend", "flash"), "--run-dir",
         str(run_dir)], capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "millstream train: error: --attention-backend flash picks Megatron's" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (run_dir / "logs").exists() and not (run_dir / "redis").exists()


def test_several_refused_flags_are_named_in_one_message():
    flags = ["--attention-backend", "flash", "--tensor-model-parallel-size", "2",
             "--hidden-dropout", "0.1"]  # fmt: skip
    cfg = parse_run_config(arith_flags(*flags))
    with pytest.raises(ConfigError) as err:
        refusals.check(cfg)
    message = str(err.value)
    assert message.startswith("--tensor-model-parallel-size 2 needs --train-backend megatron")
    assert message.endswith("(also refused: --hidden-dropout, --attention-backend)")


def _script_argv(script: Path, env: dict[str, str]) -> list[str]:
    out = subprocess.run(
        ["bash", str(script)], env={**os.environ, **env}, capture_output=True, check=True,
        timeout=30,
    ).stdout  # fmt: skip
    return out.decode().split("\0")[:-1]


def test_the_miles_qwen3_script_is_refused_for_what_the_torch_backend_does_not_do():
    """examples/miles_compat/run-qwen3-4B.sh parses unchanged; preflight then refuses it,
    naming every flag that asks for Megatron, GPUs or SGLang servers."""
    argv = _script_argv(REPO / "examples" / "miles_compat" / "run-qwen3-4B.sh",
                        {"MILLSTREAM_PRINT_ARGS": "1"})  # fmt: skip
    cfg = parse_run_config(argv, mode="async", prog="millstream train-async")
    assert list(refusals.refused(cfg)) == [
        "--tensor-model-parallel-size", "--sequence-parallel", "--recompute-granularity",
        "--recompute-method", "--recompute-num-layers", "--attention-backend",
    ]  # fmt: skip
    with pytest.raises(ConfigError, match=r"^--tensor-model-parallel-size 2 needs --train-backend"):
        checks.check(cfg)


@pytest.mark.parametrize("mode", ["train", "train-async"])
def test_the_arith_script_asks_for_nothing_refused(tmp_path, mode):
    recorder = tmp_path / "millstream"
    recorder.write_text("#!/bin/sh\nprintf '%s\\0' \"$@\"\n")
    recorder.chmod(0o755)
    env = {"MILLSTREAM": str(recorder), "RUN_DIR": str(tmp_path / "run"), "MODE": mode}
    _, *argv = _script_argv(ARITH / "run.sh", env)
    cfg = parse_run_config(argv, mode="sync" if mode == "train" else "async")
    assert refusals.refused(cfg) == {}
    refusals.check_model(cfg)


# -- matched: MODEL_ARGS given must agree with the checkpoint's config.json -------------------

CONFIG = {
    "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 256,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "vocab_size": 259, "max_position_embeddings": 64,
    "tie_word_embeddings": False, "hidden_act": "silu", "model_type": "qwen3",
}  # fmt: skip
# What a flag that can only say "yes" disagrees with.
SAYS_NO = {"tie_word_embeddings": True, "hidden_act": "gelu", "model_type": "llama",
           "attention_bias": False, "mlp_bias": True}  # fmt: skip
# field: (flags that agree with CONFIG, flags that do not, or None where no value can disagree)
MATCH_EXAMPLES = {
    "num_layers": (["--num-layers", "2"], ["--num-layers", "36"]),
    "hidden_size": (["--hidden-size", "64"], ["--hidden-size", "2560"]),
    "ffn_hidden_size": (["--ffn-hidden-size", "256"], ["--ffn-hidden-size", "9728"]),
    "num_attention_heads": (["--num-attention-heads", "4"], ["--num-attention-heads", "32"]),
    "num_query_groups": (["--num-query-groups", "2"], ["--num-query-groups", "8"]),
    "kv_channels": (["--kv-channels", "16"], ["--kv-channels", "128"]),
    "normalization": (["--normalization", "RMSNorm"], ["--normalization", "LayerNorm"]),
    "norm_epsilon": (["--norm-epsilon", "1e-6"], ["--norm-epsilon", "1e-5"]),
    "rotary_base": (["--rotary-base", "1e6"], ["--rotary-base", "10000"]),
    "vocab_size": (["--vocab-size", "259"], ["--vocab-size", "151936"]),
    "max_position_embeddings": (
        ["--max-position-embeddings", "64"], ["--max-position-embeddings", "40960"]
    ),
    "untie_embeddings_and_output_weights": (["--untie-embeddings-and-output-weights"], None),
    "swiglu": (["--swiglu"], None),
    "add_qkv_bias": (["--add-qkv-bias"], None),  # a Qwen3 has no attention_bias key: unchecked
    "qk_layernorm": (["--qk-layernorm"], None),
    "disable_bias_linear": (["--disable-bias-linear"], None),
    "position_embedding_type": (
        ["--position-embedding-type", "rope"], ["--position-embedding-type", "learned_absolute"]
    ),
}  # fmt: skip


def _model(tmp_path: Path, **changes) -> Path:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({**CONFIG, **changes}))
    return model


def _cfg_with_model(model: Path, flags: list[str]):
    argv = arith_flags(*flags)
    argv[argv.index("--hf-checkpoint") + 1] = str(model)
    return parse_run_config(argv)


def test_every_matched_flag_has_an_example():
    assert set(MATCH_EXAMPLES) == set(refusals.MATCHED)


@pytest.mark.parametrize("name", sorted(refusals.MATCHED))
def test_a_matched_flag_passes_when_it_agrees_and_exits_2_when_not(tmp_path, name):
    agree, disagree = MATCH_EXAMPLES[name]
    model = _model(tmp_path)
    refusals.check_model(_cfg_with_model(model, agree))
    if disagree is None:  # a flag that can only say "yes": make the checkpoint say "no"
        model = _model(tmp_path, **SAYS_NO)
        disagree = agree
    with pytest.raises(ConfigError) as err:
        refusals.check_model(_cfg_with_model(model, disagree))
    message = str(err.value)
    assert message.startswith(disagree[0]) and " disagrees with the model" in message, message
    assert f"--hf-checkpoint {model}" in message


def test_the_checkpoint_is_read_as_transformers_writes_it(tmp_path):
    """The arith model's config.json: rope_theta under rope_parameters, no head_dim."""
    cfg = parse_run_config(arith_flags("--rotary-base", "10000", "--kv-channels", "16",
                                 "--num-query-groups", "2", "--norm-epsilon", "1e-6"))  # fmt: skip
    refusals.check_model(cfg)
    with pytest.raises(ConfigError, match=r"^--rotary-base 1000000.0 .*rope_theta 10000"):
        refusals.check_model(parse_run_config(arith_flags("--rotary-base", "1000000")))
    # a multimodal model: its language model's config; a key it lacks is not checked
    model = tmp_path / "vl"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"text_config": {"num_hidden_layers": 2}}))
    refusals.check_model(_cfg_with_model(model, ["--num-layers", "2", "--hidden-size", "7"]))
    with pytest.raises(ConfigError, match=r"^--num-layers 3 "):
        refusals.check_model(_cfg_with_model(model, ["--num-layers", "3"]))


def test_a_disagreeing_model_flag_exits_2_through_preflight(monkeypatch, capsys, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(ARITH / "model", model)
    argv = arith_flags("--num-layers", "36")
    argv[argv.index("--hf-checkpoint") + 1] = str(model)
    assert _exit_status(monkeypatch, argv) == 2
    err = capsys.readouterr().err
    assert "millstream train: error: --num-layers 36 disagrees with the model" in err
    assert "num_hidden_layers 2" in err


def test_miles_fully_async_with_train_runs_train_async(monkeypatch, capsys):
    modes = []
    monkeypatch.setattr(main, "_run_trainer", lambda cfg: modes.append(cfg.mode) or 0)
    monkeypatch.setattr(main, "_apply_cpu_budget", lambda cfg: None)
    assert main.train(arith_flags("--fully-async")) == 0
    assert modes == ["async"]
    assert "--fully-async: running as millstream train-async" in capsys.readouterr().out


OPD_MISMATCHES = [
    (["--opd-type", "megatron", "--opd-teacher-url", "http://t"], "give --opd-teacher-load"),
    (["--opd-type", "sglang", "--opd-teacher-load", "t"], "give --opd-teacher-url, not --opd-"),
]


@pytest.mark.parametrize(("flags", "error"), OPD_MISMATCHES)
def test_miles_opd_type_is_checked_against_the_teacher_given(capsys, flags, error):
    with pytest.raises(SystemExit):
        parse_run_config(arith_flags("--use-opd", *flags))
    assert error in capsys.readouterr().err
    parse_run_config(arith_flags("--use-opd", "--opd-type", "megatron", "--opd-teacher-load", "t"))
    parse_run_config(
        arith_flags("--use-opd", "--opd-type", "sglang", "--opd-teacher-url", "http://t")
    )


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--lora-rank", "8"], "--lora-rank is LoRA training, which is not built"),
        (["--no-sglang-enable-foo"], "is not how SGLang's server flags are given here"),
        (
            ["--moe-router-topk", "2"],
            "--moe-router-topk is a Megatron setting millstream does not build",
        ),
        (["--custom-loss-function-path", "m.f"], "the torch backend has no such seam"),
        (["--loss-type", "sft_loss"], "millstream has the policy loss only"),
        (["--opd-teacher-urls", "a,b"], "give one, --opd-teacher-url URL"),
        (["--use-mlflow"], "use --use-wandb or --tensorboard-dir"),
        (["--made-up-flag=3"], "--made-up-flag is not a flag millstream knows"),
    ],
)
def test_a_miles_flag_millstream_lacks_exits_2_saying_whose_it_is_and_why(capsys, flags, said):
    with pytest.raises(SystemExit) as exit_info:
        parse_run_config(arith_flags(*flags))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"millstream train: error: {flags[0].split('=')[0]}" in err and said in err, err


def test_every_unknown_flag_is_named_in_one_message(capsys):
    with pytest.raises(SystemExit):
        parse_run_config(arith_flags("--lora-rank", "8", "--debug-train-only", "--zzz"))
    err = capsys.readouterr().err
    assert "error: --lora-rank is LoRA" in err
    assert "also: --debug-train-only is Miles' own test and debug tooling" in err
    assert "also: --zzz is not a flag millstream knows" in err


def test_use_distributed_optimizer_is_the_megatron_backends_without_model_parallelism():
    """--use-distributed-optimizer (Miles' OPTIMIZER_ARGS often carry it): megatron's, so the
    torch backend refuses it by name; with tensor parallelism it is not built, and says so."""
    torch_cfg = parse_run_config(["--rollout-batch-size", "2", "--use-distributed-optimizer"])
    assert list(refusals.refused(torch_cfg)) == ["--use-distributed-optimizer"]
    assert "--train-backend fsdp" in refusals.refused(torch_cfg)["--use-distributed-optimizer"]
    megatron = ["--rollout-batch-size", "2", "--train-backend", "megatron",
                "--use-distributed-optimizer"]  # fmt: skip
    assert refusals.refused(parse_run_config(megatron)) == {}
    tp2 = parse_run_config([*megatron, "--tensor-model-parallel-size", "2",
                            "--actor-num-gpus-per-node", "2", "--hf-checkpoint", "m",
                            "--prompt-data", "p.jsonl", "--rm-type", "math",
                            "--num-rollout", "1"])  # fmt: skip
    with pytest.raises(ConfigError, match=r"^--use-distributed-optimizer with --tensor-model"):
        checks.check(tp2)
