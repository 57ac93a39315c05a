"""The weight routes' one name each (common/weight_routes.py), from --update-weight-transport to
what an engine advertises, and the flag parsed and checked in one place: the config."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from millstream.common import weight_routes
from millstream.common.config import ConfigError, parse_run_config
from millstream.common.config.sglang import SglangConfig
from millstream.common.weight_routes import AUTO, DISK, NCCL, ROUTES, TENSOR
from millstream.compat.miles import make_args
from millstream.trainer.weights.routes.base import (
    CUDA_IPC,
    SGLANG,
    SGLANG_BYTES,
    SHM,
    Route,
)
from millstream.trainer.weights.routes.choose import choose, senders
from millstream.trainer.weights.routes.nccl import GroupRoute

SERVICES = Path(__file__).resolve().parents[4] / "services"

# every spelling the flag and an engine may use -> the route it means
SPELLED = {"nccl": NCCL, "group": NCCL, "distributed": NCCL, "tensor": TENSOR, "disk": DISK}


@pytest.mark.parametrize(("spelling", "route"), SPELLED.items())
def test_every_spelling_of_a_route_means_that_one_route(spelling, route):
    assert weight_routes.canonical(spelling) == route
    assert weight_routes.setting(spelling) == route
    assert weight_routes.advertised([spelling, "a-route-from-the-future"]) == {route}


def test_the_spellings_are_the_routes_their_aliases_and_auto():
    assert set(weight_routes.SPELLINGS) == {AUTO, *SPELLED}
    assert set(ROUTES) == set(SPELLED.values()) == {"nccl", "tensor", "disk"}
    assert weight_routes.setting("auto") == AUTO and weight_routes.canonical("auto") is None
    with pytest.raises(ValueError, match="'ipc': one of auto, nccl, tensor, disk, group, "):
        weight_routes.setting("ipc")


@pytest.mark.parametrize(("spelling", "route"), [("auto", AUTO), *SPELLED.items()])
def test_the_config_holds_the_routes_one_name_and_miles_sees_miles_value(spelling, route):
    cfg = parse_run_config(["--rollout-batch-size", "2", "--update-weight-transport", spelling])
    assert cfg.sglang.update_weight_transport == route
    # A Miles plugin compares args.update_weight_transport with Miles' values: nccl, disk.
    assert make_args(cfg).update_weight_transport == route
    assert SglangConfig(update_weight_transport=spelling).update_weight_transport == route


def test_the_config_refuses_a_value_no_route_has(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_run_config(["--rollout-batch-size", "2", "--update-weight-transport", "ipc"])
    assert exit_info.value.code == 2
    assert "--update-weight-transport" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--update-weight-transport 'ipc': one of"):
        SglangConfig(update_weight_transport="ipc")  # a config file's value, not argparse's


def test_an_engine_advertising_the_old_name_takes_the_same_routes():
    here = {"host": "h", "device": "cpu", "gpu_uuid": None}
    for names in (["distributed", "tensor", "disk"], ["nccl", "tensor", "disk"]):
        route = choose("auto", here, {**here, "weight_transports": names})
        assert (route.name, route.handle) == (TENSOR, SHM)
    for names in (["distributed"], ["group"], ["nccl"]):  # no tensors: the update group
        route = choose("auto", here, {**here, "weight_transports": names})
        assert route == Route(NCCL, "on this machine's CPU")
        assert str(route) == "nccl (on this machine's CPU)"  # printed by its one name


def test_every_route_choose_names_has_exactly_one_sender(tmp_path):
    async def remove(_router, engines, _failed, _report):
        return engines

    group = GroupRoute(
        master_address="127.0.0.1", group_name="g", load_format=None, timeout_s=1, remove=remove
    )
    every = senders(group, disk_dir=tmp_path, shm_dir=str(tmp_path))
    try:
        assert {s.name for s in every} == set(ROUTES)
        for route in (
            Route(NCCL, ""),
            Route(TENSOR, "", CUDA_IPC),
            Route(TENSOR, "", SHM),
            Route(TENSOR, "", SGLANG),
            Route(TENSOR, "", SGLANG_BYTES),
            Route(DISK, ""),
        ):
            assert len([s for s in every if s.serves(route)]) == 1, route
    finally:
        for sender in every:
            sender.close()


def _flag_checks(rel: str, source: str) -> list[str]:
    """Where `source` checks the flag itself: reads weight_routes' spellings or `setting`,
    keeps a list of the flag's values ("auto" beside a route's name), or tests a value's
    membership in such a list."""
    found = []
    for node in ast.walk(ast.parse(source, rel)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("weight_routes"):
            if {"SPELLINGS", "setting"} & {a.name for a in node.names}:
                found.append(f"{rel}:{node.lineno} imports the flag's check")
        elif isinstance(node, ast.Attribute) and node.attr in ("SPELLINGS", "setting"):
            if isinstance(node.value, ast.Name) and node.value.id == "weight_routes":
                found.append(f"{rel}:{node.lineno} calls the flag's check")
        elif isinstance(node, ast.Tuple | ast.List | ast.Set):
            values = {e.value for e in node.elts if isinstance(e, ast.Constant)}
            if AUTO in values and values & set(SPELLED):
                found.append(f"{rel}:{node.lineno} lists the flag's values")
        elif isinstance(node, ast.Compare) and any(
            isinstance(op, ast.In | ast.NotIn) for op in node.ops
        ):
            names = [getattr(c, "id", getattr(c, "attr", "")) for c in node.comparators]
            if any(n in ("SETTINGS", "SPELLINGS") for n in names):
                found.append(f"{rel}:{node.lineno} checks a value against the flag's values")
    return found


def test_the_flag_is_checked_in_one_place():
    """The config alone checks --update-weight-transport (common/weight_routes.py `setting`);
    the trainer takes what the config holds."""
    found = [
        check
        for path in sorted(SERVICES.rglob("*.py"))
        if (rel := str(path.relative_to(SERVICES))) != "common/weight_routes.py"
        for check in _flag_checks(rel, path.read_text())
    ]
    assert [f.split(":")[0] for f in found] == ["common/config/sglang.py"] * 2, found
    # The checks the trainer used to make of its own are found (this test can fail).
    assert _flag_checks("sync.py", "if transport not in SETTINGS: raise ValueError()")
    assert _flag_checks("sglang.py", 'choices=("auto", "nccl", "tensor", "disk")')
