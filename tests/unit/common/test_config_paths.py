"""Every flag that names a file or directory is absolute in the resolved run config (against
the trainer's working directory), so a worker started elsewhere reads the same files; plugin
module paths and URLs stay as given."""

from __future__ import annotations

import dataclasses
import os

from millstream.common.config import PATH_FLAGS, parse_run_config
from millstream.common.config import store as config_store


def test_relative_paths_become_absolute_and_the_rest_stays(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "secret").write_text("pw\n")
    cfg = parse_run_config(
        [
            "--rollout-batch-size", "1", "--run-id", "paths",
            "--hf-checkpoint", "model", "--ref-load", "./ref", "--load", "ckpt", "--save", "ckpt",
            "--critic-load", "critic", "--opd-teacher-load", "teacher",
            "--prompt-data", "data/train.jsonl", "--eval-prompt-data", "aime", "data/aime.jsonl",
            "gsm8k", "/abs/gsm8k.jsonl", "--tensorboard-dir", "tb", "--wandb-dir", "wb",
            "--memory-snapshot-path", "m.pickle", "--update-weight-disk-dir", "updates",
            "--redis-password-file", "secret",
            "--custom-rm-path", "my_rewards.score", "--rm-url", "http://rm:8000/score",
            "--data-source-path", "pkg.sources.Source",
        ]
    )  # fmt: skip
    here = str(tmp_path)
    assert cfg.ckpt.hf_checkpoint == f"{here}/model" and cfg.ckpt.ref_load == f"{here}/ref"
    assert cfg.ckpt.load == cfg.ckpt.save == f"{here}/ckpt"
    assert (cfg.algo.critic_load, cfg.algo.opd_teacher_load) == (
        f"{here}/critic",
        f"{here}/teacher",
    )
    assert cfg.rollout.prompt_data == f"{here}/data/train.jsonl"
    assert cfg.eval.datasets() == {"aime": f"{here}/data/aime.jsonl", "gsm8k": "/abs/gsm8k.jsonl"}
    assert (cfg.logging.tensorboard_dir, cfg.logging.wandb_dir) == (f"{here}/tb", f"{here}/wb")
    assert cfg.profiling.memory_snapshot_path == f"{here}/m.pickle"
    assert cfg.sglang.update_weight_disk_dir == f"{here}/updates"
    assert cfg.connection.redis_password_file == f"{here}/secret"
    assert cfg.run_dir == f"{here}/runs/paths"  # the default run dir too
    # Module paths and URLs are not files.
    assert cfg.reward.custom_rm_path == "my_rewards.score"
    assert cfg.reward.rm_url == "http://rm:8000/score"
    assert cfg.rollout.data_source_path == "pkg.sources.Source"
    # What workers read: the published config, through its JSON round trip.
    published = config_store.loads(config_store.dumps(cfg))
    assert published.ckpt.hf_checkpoint == f"{here}/model" and published.run_dir == cfg.run_dir


def test_every_path_flag_is_a_field_and_unset_ones_stay_unset(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = parse_run_config(["--rollout-batch-size", "1", "--run-dir", "../elsewhere"])
    for group, fields in PATH_FLAGS.items():
        names = {f.name for f in dataclasses.fields(getattr(cfg, group))}
        assert set(fields) <= names, (group, set(fields) - names)
    assert cfg.ckpt.hf_checkpoint is None and cfg.rollout.prompt_data is None
    assert cfg.run_dir == os.path.abspath(tmp_path / ".." / "elsewhere")
