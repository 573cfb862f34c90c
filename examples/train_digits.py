"""Convergence comparison on scikit-learn's bundled digits (no download), 4 gloo ranks.

    python examples/train_digits.py            # same as: sparsecomm train (Dense and Ok-Topk, ~40 s)
    python examples/train_digits.py --full     # every configuration, 30 epochs (~5 min)
    python examples/train_digits.py --epochs 20 --configs dense,oktopk,topka

Writes train/train.json and train/train.png and prints the final table.
"""

import sys

from sparsecomm.tools.cli import main as cli


def main() -> int:
    return cli(["train", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
