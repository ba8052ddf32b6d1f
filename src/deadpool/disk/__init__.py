"""The disk tier: checkpoints of committed snapshots in torch.distributed.checkpoint format, visible only once
complete (parts in a temporary directory, one merged DCP metadata, the manifest last, rename).

    root/step-{step:010d}/  .metadata  manifest.json  part-{writer}/{__0_0.distcp, .metadata, part.json}

The disk is trusted as far as DCP's own metadata loading goes (DCP unpickles `.metadata`); all else is JSON
and every file is checked against its xxh3-128 hash before it is read.
"""

import warnings

from deadpool.disk.chunks import Chunk, RankChunks, chunk_rank, meta_key, private_key
from deadpool.disk.finish import finalize, prune
from deadpool.disk.manifest import Identity, compatible, listing, step_dir, tmp_dir
from deadpool.disk.read import newest, read_rank, read_resharded, verify
from deadpool.disk.write import write_part

__all__ = ["Chunk", "Identity", "RankChunks", "chunk_rank", "compatible", "finalize", "listing", "meta_key", "newest",
           "private_key", "prune", "read_rank", "read_resharded", "step_dir", "tmp_dir", "verify", "write_part"]

# Every process writes and reads its own part on purpose (DCP's no_dist): DCP would warn of it at every call,
# in every rank's output. Only that warning is silenced.
warnings.filterwarnings("ignore", category=UserWarning, message=r"torch\.distributed is (disabled, )?unavailable or "
                        r"uninitialized, assuming the intent is to (save|load) in a single process")
