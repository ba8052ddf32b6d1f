"""Runs examples/gpt/train.py with gradient buckets of CAP MB (session.wrap's bucket_cap_mb, as DDP's), and
writes to LAYOUT (rank 0) the bucket layout and the parameter whose gradient the fault point "backward"
waits for (session.wrap's hook midway through the parameters).
Usage: small_buckets.py CAP LAYOUT [script args...]
"""

import json
import os
import runpy
import sys
from pathlib import Path
from typing import Any

from deadpool.runtime.session import Session

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "gpt" / "train.py"
cap, layout = float(sys.argv[1]), Path(sys.argv[2])
wrap = Session.wrap


def small_buckets(self: Session, model: Any, bucket_cap_mb: float | None = None) -> Any:
    wrapped = wrap(self, model, bucket_cap_mb=cap)
    if os.environ["RANK"] == "0":
        point = len([p for p in model.parameters() if p.requires_grad]) // 2
        layout.write_text(json.dumps({"buckets": wrapped.reducer.layout, "backward_point": point}))
    return wrapped


Session.wrap = small_buckets  # type: ignore[method-assign]
sys.path.insert(0, str(EXAMPLE.parent))
sys.argv = [str(EXAMPLE), *sys.argv[3:]]
runpy.run_path(str(EXAMPLE), run_name="__main__")
