"""A learner of ``Wide`` (a small layer beside one of 10^7 parameters) that declares the job's model and
stays attached, for tests/test_partial.py.

    wide_learner.py JOB

Prints "ready" once attached; detaches and exits at the end of its stdin (or when killed).
"""

import sys

import torch

from psd import learner


class Wide(torch.nn.Module):
    """A small layer beside a wide one (10^7 parameters, 40 MB)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 8)
        self.b = torch.nn.Linear(3162, 3162)


def main() -> int:
    torch.set_num_threads(1)
    with learner.attach(Wide(), job=sys.argv[1], timeout=60):
        print("ready", flush=True)
        sys.stdin.read()
    return 0


if __name__ == "__main__":
    sys.exit(main())
