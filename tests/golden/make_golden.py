"""Regenerate the golden losses: ``python tests/golden/make_golden.py`` (then review the diff).

Runs the same fixed-seed configuration as tests/test_train.py::test_golden_losses and
writes the per-step losses it produced; numbers are never typed in by hand.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from test_train import GOLDEN, GOLDEN_OVERRIDES, run_ranks  # noqa: E402

if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        metrics = run_ranks(GOLDEN_OVERRIDES, tmp)
    GOLDEN.write_text(json.dumps({"overrides": GOLDEN_OVERRIDES, "losses": [r["loss"] for r in metrics]}, indent=1))
    print(f"wrote {GOLDEN}")
