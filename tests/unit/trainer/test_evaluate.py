"""Eval accuracies are picked by data-set name, so names with underscores are not lost."""

from millstream.trainer.evaluate import accuracies, format_accuracies


def test_accuracies_by_name_keep_underscored_names():
    metrics = {
        "eval/aime_2024": 0.25, "eval/aime_2024_reward": 0.1, "eval/aime_2024_seconds": 3.0,
        "eval/math": 0.5, "eval/math_failed_groups": 0,
    }  # fmt: skip
    acc = accuracies(["aime_2024", "math"], metrics)
    assert acc == {"aime_2024": 0.25, "math": 0.5}
    assert format_accuracies(acc) == "aime_2024=0.250 math=0.500"
