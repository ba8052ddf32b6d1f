"""The disk tier: checkpoints of committed snapshots in torch.distributed.checkpoint format, visible only once
complete (parts in a temporary directory, one merged DCP metadata, the manifest last, rename).

    root/step-{step:010d}/  .metadata  manifest.json  part-{writer}/{__0_0.distcp, .metadata, part.json}

The disk is trusted as far as DCP's own metadata loading goes (DCP unpickles `.metadata`); all else is JSON
and every file is checked against its xxh3-128 hash before it is read.
"""

from deadpool.disk.chunks import Chunk, RankChunks, chunk_rank, meta_key, private_key
from deadpool.disk.finish import finalize, prune
from deadpool.disk.manifest import Identity, compatible, listing, step_dir, tmp_dir
from deadpool.disk.read import newest, read_rank, verify
from deadpool.disk.write import write_part

__all__ = ["Chunk", "Identity", "RankChunks", "chunk_rank", "compatible", "finalize", "listing", "meta_key", "newest",
           "private_key", "prune", "read_rank", "step_dir", "tmp_dir", "verify", "write_part"]
