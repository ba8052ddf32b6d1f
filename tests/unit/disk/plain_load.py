"""Opens a DeadPool checkpoint with torch's own tools only: `python plain_load.py CHECKPOINT OUT_DIR`.

Writes OUT_DIR/model.pt (the state a plain model got from dcp.load) and OUT_DIR/full.pt (dcp_to_torch_save)."""

import sys
import warnings

import torch
import torch.distributed.checkpoint as dcp
from plain_model import Tiny
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

warnings.simplefilter("ignore")
checkpoint, out = sys.argv[1], sys.argv[2]
model = Tiny()
for p in model.state_dict().values():
    p.data.fill_(-1.0) if p.is_floating_point() else p.data.fill_(-1)
state = {"model": model.state_dict()}
dcp.load(state, checkpoint_id=checkpoint)
model.load_state_dict(state["model"])
assert model.head.weight is model.wte.weight
torch.save(model.state_dict(), f"{out}/model.pt")
dcp_to_torch_save(checkpoint, f"{out}/full.pt")
assert not any(name.startswith("deadpool") for name in sys.modules), "imported deadpool"
print("ok")
