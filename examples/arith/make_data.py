"""Write the arith task's prompt data: data/train.jsonl and data/eval.jsonl (deterministic).

    .venv/bin/python examples/arith/make_data.py [--out DIR]

Each line is {"prompt": "37+45=", "label": "82"}. The two files are disjoint and together hold
all 8100 problems with operands 10..99; eval.jsonl is the 200 held-out ones (task.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from task import DATA_DIR, rows_of, split_problems, write_jsonl


def make_data(out: Path) -> tuple[Path, Path]:
    train, held_out = split_problems()
    train_path, eval_path = out / "train.jsonl", out / "eval.jsonl"
    write_jsonl(train_path, rows_of(train))
    write_jsonl(eval_path, rows_of(held_out))
    return train_path, eval_path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DATA_DIR, help="output folder")
    args = parser.parse_args(argv)
    for path in make_data(args.out):
        lines = sum(1 for _ in path.open(encoding="utf-8"))
        print(f"wrote {path} ({lines} problems)")


if __name__ == "__main__":
    main()
