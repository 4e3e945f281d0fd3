"""A psd run learner that trains examples/hf_trainer.py's tiny BERT with the Hugging Face Trainer.

Gradient accumulation 2 in the Trainer (it zeroes the gradients after each optimizer step) on top of the
job's --push-every; rank 1's first life dies (os._exit) after optimizer step DIE_AT; psd run restarts it and
psd.learner.hf.ResumeCallback skips what the job applied. Prints "learner R: done ... accuracy A".
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from transformers import TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import hf_trainer

DIE_AT = 5


class DieOnce(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if os.environ.get("PSD_RESTARTS") == "0" and os.environ.get("PSD_RANK") == "1" and state.global_step == DIE_AT:
            os._exit(9)


def main() -> int:
    torch.set_num_threads(1)
    hf_trainer.EXTRA_CALLBACKS.append(DieOnce())
    return hf_trainer.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
