"""One torchrun worker of `orangetron train`, with a fault planted on one rank (see tests/test_faults.py), or
none (FAULT "none", tests/test_stop.py). Each worker creates PID_DIR/<its pid> and writes its exit code there.

    python -m torch.distributed.run --nproc-per-node 2 tests/torchrun_fault.py RANK STEP FAULT PID_DIR -- ARGS
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from test_faults import FAULTS, _in_backward, _planted

from orangetron import cli
from orangetron.train import step as step_module

if __name__ == "__main__":
    rank, at_step, fault, pid_folder = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    record = Path(pid_folder, str(os.getpid()))
    record.touch()
    if int(os.environ["RANK"]) == rank and fault != "none":
        step_module._lm_loss = _planted(at_step, _in_backward(FAULTS[fault]))
    code = cli.main(sys.argv[sys.argv.index("--") + 1:])
    record.write_text(str(code))
    sys.exit(code)
