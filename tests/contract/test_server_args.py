"""Every command line millstream's launcher builds for an SGLang server, judged by the pinned
SGLang: `prepare_server_args` parses it as `python -m sglang.launch_server` does (argparse:
exit 2 on an unknown or ambiguous flag), and where the launcher put the engine on the CPU and
the model is here, `resolve_once` checks it against the model and the device as the server
does next. The ServerArgs must carry what the launcher meant: the model, address, TP size,
memory fraction, memory saver, device and weight version it chose, and every --sglang-X
handed on with the value SGLang gets from that flag alone (another flag swallowing it, or
coming after it, would change that).

The command lines come from millstream's own code (launch/plan.py's plan, launch/engines.py's
`plan.sglang_engine_command`, as launch/cluster.py starts them): each script of
examples/miles_compat (its arguments as it passes them: test_miles_compat's helper) on the
machine it is written for and on this one, TP 2 and --colocate, and every --sglang-* flag the
docs name, the ones millstream's engine maps (docs/gpus.md lists them) among them. Then what
millstream refuses before SGLang would: a --sglang-X the launcher sets itself, and a near miss
of one of millstream's own --sglang-* flags.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import io
import logging
import re
import shlex
import sys
from pathlib import Path

import pytest
from sglang.srt.server_args import ServerArgs, prepare_server_args

from millstream.common.config import ConfigError, parse_run_config
from millstream.common.config.sglang import SERVER_PREFIX
from millstream.launch import engines
from millstream.launch.plan import (
    COLOCATED_MEM_FRACTION,
    SHARED_MEM_FRACTION,
    GpuPlan,
    gpu_plan,
    sglang_engine_command,
)
from tests.support.sglang_contract import quiet
from tests.unit.compat.test_miles_compat import SCRIPTS, _command_and_argv

REPO = Path(__file__).resolve().parents[2]
HOST, PORT = "127.0.0.1", 30011
PARSER = argparse.ArgumentParser()
ServerArgs.add_cli_args(PARSER)
OPTIONS = set(PARSER._option_string_actions)
DESTS = sorted({a.dest for a in PARSER._actions if a.option_strings} - {"help", "config"})


def _argparse_says(argv: list[str]) -> tuple[ServerArgs | None, str]:
    """(ServerArgs, "") when SGLang's parser takes `argv`, else (None, its error line)."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level  # it reconfigures logging: put them back
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return prepare_server_args(argv), ""
    except SystemExit as exit_info:
        assert exit_info.code == 2
        return None, err.getvalue().strip().splitlines()[-1]
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


def _parse(argv: list[str]) -> ServerArgs:
    server_args, error = _argparse_says(argv)
    if server_args is None:
        pytest.fail(f"SGLang refuses `{shlex.join(argv)}`: {error}", pytrace=False)
    return server_args


def _not_default(server_args: ServerArgs, base: ServerArgs) -> dict[str, object]:
    return {
        d: getattr(server_args, d) for d in DESTS if getattr(server_args, d) != getattr(base, d)
    }


def _cfg(model: str | Path, *flags: str):
    return parse_run_config(
        ["--hf-checkpoint", str(model), "--prompt-data", "p.jsonl", "--rm-type", "math",
         "--num-rollout", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
         *flags]
    )  # fmt: skip


def _launch_argvs(cfg, gpus: int) -> tuple[GpuPlan, str, list[list[str]]]:
    """(the plan on `gpus` GPUs, the model path, each engine's argv after the interpreter's
    `-m sglang.launch_server`), as the launcher builds them after its own checks."""
    plan = gpu_plan(cfg, gpus)
    engines.check(cfg, sglang=True)
    model = str(Path(cfg.ckpt.hf_checkpoint).resolve())
    argvs = []
    for k in range(len(plan.engines)):
        argv = sglang_engine_command(cfg, plan, k, model, HOST, PORT + k, "0").argv
        assert argv[:3] == [sys.executable, "-m", "sglang.launch_server"]
        argvs.append(argv[3:])
    return plan, model, argvs


def _check_server_args(cfg, gpus: int) -> list[ServerArgs]:
    """Each engine's command line parses (and resolves, on the CPU) to what was meant."""
    plan, model, argvs = _launch_argvs(cfg, gpus)
    base = _parse(["--model-path", model])
    out = []
    for k, argv in enumerate(argvs):
        server_args = _parse(argv)
        meant = {
            "model_path": model, "host": HOST, "port": PORT + k, "weight_version": "0",
            "tp_size": cfg.sglang.rollout_num_gpus_per_engine,
            "mem_fraction_static": plan.engine_fraction(cfg),
            "enable_memory_saver": cfg.sglang.colocate,
            "device": None if plan.engines[k] else "cpu",
        }  # fmt: skip
        assert {name: getattr(server_args, name) for name in meant} == meant, argv
        for name, values in engines.server_flags(cfg):
            alone = _not_default(_parse(["--model-path", model, name, *values]), base)
            assert alone, f"{name} {values}: SGLang reads nothing from it"
            lost = {
                d: getattr(server_args, d) for d, v in alone.items() if getattr(server_args, d) != v
            }
            assert not lost, f"{name} {values} means {alone}, SGLang got {lost} from {argv}"
        if server_args.device == "cpu" and Path(model).is_dir():
            with quiet():  # resolution imports more of SGLang, whose warnings are not ours
                server_args.resolve_once()
        out.append(server_args)
    return out


# -- the scripts of examples/miles_compat ------------------------------------------------------

# (script, environment, GPUs): the machine it is written for, and this one where it runs.
CASES = [
    pytest.param("run-gpu-node.sh", {}, 4),
    pytest.param("run-gpu-node.sh", {"CPU_ONLY": "1"}, 0),
    pytest.param("run-qwen3-4B.sh", {}, 8),
    *[
        pytest.param(name, {}, gpus)
        for name in SCRIPTS
        if name not in ("run-gpu-node.sh", "run-qwen3-4B.sh")
        for gpus in (1, 0)
    ],
]


def test_every_script_has_a_case():
    assert {case.values[0] for case in CASES} == set(SCRIPTS)


@pytest.mark.parametrize(("name", "env", "gpus"), CASES)
def test_each_miles_script_s_engines_are_command_lines_sglang_takes(
    monkeypatch, tmp_path, name, env, gpus
):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    command, argv = _command_and_argv(name, tmp_path)
    cfg = parse_run_config(argv, mode="sync" if command == "train" else "async")
    assert _check_server_args(cfg, gpus)


def test_the_qwen3_script_gets_four_colocated_tp2_servers(tmp_path):
    _, argv = _command_and_argv("run-qwen3-4B.sh", tmp_path)
    cfg = parse_run_config(argv, mode="async")
    servers = _check_server_args(cfg, 8)
    assert [(s.tp_size, s.mem_fraction_static, s.enable_memory_saver) for s in servers] == [
        (2, 0.7, True)
    ] * 4


# -- TP > 1 and colocation ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "gpus", "tp", "fraction", "saver", "device"),
    [
        (["--rollout-num-gpus-per-engine", "2"], 3, 2, None, False, None),  # GPUs 1-2 its own
        (["--rollout-num-gpus-per-engine", "2", "--colocate", "--actor-num-gpus-per-node", "2"],
         2, 2, COLOCATED_MEM_FRACTION, True, None),
        (["--colocate"], 1, 1, COLOCATED_MEM_FRACTION, True, None),
        ([], 1, 1, SHARED_MEM_FRACTION, False, None),  # the trainer's GPU, without turns
        (["--sglang-mem-fraction-static", "0.5", "--colocate"], 1, 1, 0.5, True, None),
        (["--rollout-num-gpus-per-engine", "2"], 0, 2, None, False, "cpu"),
    ],
)  # fmt: skip
def test_tp_and_colocation_reach_sglang(tiny_model_dir, flags, gpus, tp, fraction, saver, device):
    (server_args,) = _check_server_args(_cfg(tiny_model_dir, *flags), gpus)
    assert server_args.tp_size == tp and server_args.mem_fraction_static == fraction
    assert server_args.enable_memory_saver is saver and server_args.device == device


def test_every_form_of_a_handed_on_flag_reaches_sglang(tiny_model_dir):
    """A switch, `--sglang-x=value` and a flag of several values, one after another: none
    swallows the next or loses a value."""
    cfg = _cfg(tiny_model_dir, "--rollout-num-gpus-per-engine", "2",
               "--sglang-enable-dp-attention", "--sglang-dp-size", "2",
               "--sglang-chunked-prefill-size=4096", "--sglang-cuda-graph-bs-decode", "1", "2",
               "4", "--sglang-log-level", "warning")  # fmt: skip
    (s,) = _check_server_args(cfg, 0)
    assert (s.enable_dp_attention, s.dp_size, s.chunked_prefill_size) == (True, 2, 4096)
    assert (s.cuda_graph_bs_decode, s.log_level) == ([1, 2, 4], "warning")


# -- every --sglang-* flag the docs name -------------------------------------------------------

# flag -> (values, what SGLang's ServerArgs gets; None: millstream's own, not SGLang's).
DOCS_FLAGS: dict[str, tuple[list[str], dict[str, object] | None]] = {
    "--sglang-mem-fraction-static": (["0.55"], {"mem_fraction_static": 0.55}),
    "--sglang-server-concurrency": (["1024"], None),  # Miles': GenerateState's semaphore
    "--sglang-context-length": (["48"], {"context_length": 48}),
    "--sglang-log-level": (["warning"], {"log_level": "warning"}),
    "--sglang-cuda-graph-max-bs-decode": (["16"], {"cuda_graph_max_bs_decode": 16}),
    "--sglang-disable-cuda-graph": ([], {"disable_cuda_graph": True}),
    "--sglang-max-running-requests": (["8"], {"max_running_requests": 8}),
    "--sglang-max-total-tokens": (["4096"], {"max_total_tokens": 4096}),
    "--sglang-dtype": (["float32"], {"dtype": "float32"}),
    "--sglang-random-seed": (["7"], {"random_seed": 7}),
    "--sglang-served-model-name": (["arith"], {"served_model_name": "arith"}),
    "--sglang-dp-size": (["2"], {"dp_size": 2}),  # also read by millstream (args.sglang_dp_size)
}
# Names millstream's engine takes that the pinned SGLang refuses, with SGLang's message.
OLDER_SGLANG = {
    "--sglang-cuda-graph-max-bs": "ambiguous option: --cuda-graph-max-bs could match "
    "--cuda-graph-max-bs-decode, --cuda-graph-max-bs-prefill",
}


def _docs_flags() -> set[str]:
    texts = [REPO / "README.md", *REPO.glob("docs/*.md"), *REPO.glob("examples/*/README.md")]
    named = {m for p in texts for m in re.findall(r"--sglang-[a-z0-9-]*[a-z0-9]", p.read_text())}
    return named | {SERVER_PREFIX + name[2:] for name in engines.SGLANG_TO_ENGINE}


# Named in the docs as what millstream refuses (docs/gpus.md): a flag the launcher sets itself,
# and a near miss of its own; each refused below (the two tests after the table's).
REFUSED_IN_DOCS = {"--sglang-model-path", "--sglang-mem-fraction-statik"}


def test_the_table_covers_every_sglang_flag_the_docs_name():
    assert _docs_flags() - set(OLDER_SGLANG) - REFUSED_IN_DOCS <= set(DOCS_FLAGS)


@pytest.mark.parametrize("flag", sorted(REFUSED_IN_DOCS))
def test_a_flag_the_docs_name_as_refused_is_refused(tiny_model_dir, flag):
    with pytest.raises(ConfigError, match=f"^{flag}: "):
        engines.check(_cfg(str(tiny_model_dir), flag, "x"), sglang=True)


@pytest.mark.parametrize("flag", sorted(DOCS_FLAGS))
def test_each_sglang_flag_the_docs_name_reaches_sglang_as_meant(tiny_model_dir, flag):
    values, meant = DOCS_FLAGS[flag]
    cfg = _cfg(tiny_model_dir, flag, *values)
    (server_args,) = _check_server_args(cfg, 0)
    if meant is None:
        _, _, (argv,) = _launch_argvs(cfg, 0)
        assert "--" + flag[len(SERVER_PREFIX) :] not in argv
        return
    assert {name: getattr(server_args, name) for name in meant} == meant


@pytest.mark.parametrize("flag", sorted(OLDER_SGLANG))
def test_older_sglang_names_are_refused_by_the_pinned_sglang(tiny_model_dir, flag):
    cfg = _cfg(tiny_model_dir, flag, "16")
    _, _, (argv,) = _launch_argvs(cfg, 0)
    server_args, error = _argparse_says(argv)
    assert server_args is None and error == f"sglang serve: error: {OLDER_SGLANG[flag]}"


# -- what millstream refuses before SGLang would ---------------------------------------------


def test_a_misspelled_flag_is_refused_by_sglang_and_a_near_miss_of_ours_by_millstream(
    tiny_model_dir,
):
    model = str(tiny_model_dir)
    cfg = _cfg(model, "--sglang-mem-fraction-statik", "0.7")
    argv = engines.sglang_command(cfg, model, HOST, PORT, "0", None).argv[3:]  # unrefused
    assert argv[-2:] == ["--mem-fraction-statik", "0.7"]
    server_args, error = _argparse_says(argv)
    assert server_args is None
    assert error == "sglang serve: error: unrecognized arguments: --mem-fraction-statik 0.7"
    with pytest.raises(ConfigError, match=r"^--sglang-mem-fraction-statik: not a flag; did you "
                       r"mean --sglang-mem-fraction-static\?$"):  # fmt: skip
        engines.check(cfg, sglang=True)
    # A typo of SGLang's own flag: millstream hands it on; SGLang refuses it as the server starts.
    cfg = _cfg(model, "--sglang-context-lenght", "64")
    _, _, (argv,) = _launch_argvs(cfg, 0)
    server_args, error = _argparse_says(argv)
    assert server_args is None
    assert error == "sglang serve: error: unrecognized arguments: --context-lenght 64"


@pytest.mark.parametrize(
    ("given", "value", "dest", "owned"),
    [
        ("--sglang-port", "9999", "port", "--port"),
        ("--sglang-host", "0.0.0.0", "host", "--host"),
        ("--sglang-tp", "4", "tp_size", "--tp-size"),  # argparse expands the prefix
        ("--sglang-tensor-parallel-size", "4", "tp_size", "--tensor-parallel-size"),
        ("--sglang-model", "/elsewhere", "model_path", "--model"),
        ("--sglang-device", "cuda", "device", "--device"),
        ("--sglang-weight-version", "7", "weight_version", "--weight-version"),
    ],
)
def test_a_server_flag_the_launcher_sets_is_refused_before_it_would_win(
    tiny_model_dir, given, value, dest, owned
):
    model = str(tiny_model_dir)
    cfg = _cfg(model, given, value)
    argv = engines.sglang_command(cfg, model, HOST, PORT, "0", None, on_gpu=False).argv[3:]
    assert str(getattr(_parse(argv), dest)) == value  # handed on, it overrides the launcher's
    with pytest.raises(ConfigError, match=f"^{given}: the launcher sets SGLang's {owned} itself"):
        engines.check(cfg, sglang=True)


def test_the_launcher_s_tables_name_the_pinned_sglang_s_flags():
    """Each flag the launcher sets or maps is one SGLang 0.5.23 has, and neither refusal takes
    a flag of SGLang's that the launcher leaves to the user."""
    assert set(engines.LAUNCHER_SETS) <= OPTIONS
    older = {"--" + flag[len(SERVER_PREFIX) :] for flag in OLDER_SGLANG}
    assert set(engines.SGLANG_TO_ENGINE) - older <= OPTIONS
    for option in OPTIONS - set(engines.LAUNCHER_SETS):
        if option.startswith("--"):
            assert engines._launcher_set(option) is None, option
            given = SERVER_PREFIX + option[2:]
            if given not in engines.OWN_FLAGS:
                assert not difflib.get_close_matches(
                    given, engines.OWN_FLAGS, n=1, cutoff=engines.NEAR_MISS
                ), option
