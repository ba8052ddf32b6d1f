"""Trains the character-level GPT data-parallel on real text; DeadPool keeps it running through failures.

Run it with `deadpool run --workers 4 --spares 1 examples/gpt/train.py`. Compared with a plain DDP
script, the lines marked `# DeadPool` are the whole change. `--parallel fsdp` shards the parameters and
optimizer state over the ranks with FSDP2's fully_shard (each transformer block, then the whole model):
each rank then holds, and snapshots, only its own shards.
"""

from __future__ import annotations

import argparse

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import deadpool  # DeadPool
from data import BatchSampler, CharTokenizer, load_text, make_batch
from model import GPT, GPTConfig


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--data", default=None, help="a UTF-8 text file (default: the Python docs' topics)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--log-samples", action="store_true", help="record each step's sample ids in the events")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (spares compile while waiting)")
    p.add_argument("--parallel", choices=("ddp", "fsdp"), default="ddp",
                   help="ddp: every rank holds the whole model; fsdp: each holds a shard of it (FSDP2)")
    args = p.parse_args()
    if args.compile and args.parallel == "fsdp":
        p.error("--compile is supported with --parallel ddp only in this example")
    return args


def main() -> None:
    args = parse_args()
    text = load_text(args.data)
    tokenizer = CharTokenizer(text)
    tokens = torch.tensor(tokenizer.encode(text), dtype=torch.long)
    config = GPTConfig(vocab_size=tokenizer.vocab_size, block_size=args.block_size, n_layer=args.n_layer,
                       n_head=args.n_head, n_embd=args.n_embd, dropout=args.dropout)

    def build() -> torch.nn.Module:
        return torch.compile(GPT(config)) if args.compile else GPT(config)

    def warm_up() -> None:
        """What a spare runs while it waits: the compiled model's first forward and backward on a batch
        like training's (same shapes, and inputs distinct from targets: torch.compile guards on both),
        so that the model it builds once called runs compiled code at once."""
        x, y = make_batch(tokens, list(range(args.batch_size)), args.block_size)
        build()(x, y)[1].backward()

    def shard(model: torch.nn.Module) -> torch.nn.Module:
        """FSDP2: every rank built the same model from the same seed; each keeps its own shard of it."""
        mesh = init_device_mesh(session.device.type, (session.world_size,))
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh)
        return fully_shard(model.to(session.device), mesh=mesh)

    # DeadPool: instead of dist.init_process_group("gloo"); seeds Python's, NumPy's and torch's RNGs
    session = deadpool.init(warmup=warm_up if args.compile else None)
    torch.manual_seed(args.seed)  # after init(), which seeds torch with --seed plus the rank: every rank alike
    # DeadPool: instead of DistributedDataParallel(GPT(config)), or of the sharded model as it is
    model = session.wrap(shard(GPT(config)) if args.parallel == "fsdp" else build())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    sampler = BatchSampler(num_tokens=len(tokens), block_size=args.block_size, batch_size=args.batch_size,
                           rank=session.rank, world_size=session.world_size, seed=args.seed)
    session.register(model=model, optimizer=optimizer, data=sampler)  # DeadPool
    if session.rank == 0 and session.step == 0:
        gpt = model if args.parallel == "fsdp" else model.module
        print(f"GPT with {gpt.num_parameters():,} parameters on {len(tokens):,} characters, "
              f"{session.world_size} ranks x {args.batch_size} sequences of {args.block_size} ({args.parallel})",
              flush=True)

    def train_step(step: int) -> torch.Tensor:  # DeadPool: was `for step in range(1, args.steps + 1):`
        sample_ids = sampler.next_batch()
        x, y = make_batch(tokens, sample_ids, args.block_size, session.device)  # the model's device (GPU or CPU)
        _, loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if args.log_samples:
            session.log("batch", step=step, samples=sample_ids)
        if session.rank == 0 and step % args.log_every == 0 and not session.replaying:  # DeadPool: printed once
            print(f"step {step:4d} | loss {loss.item():.4f}", flush=True)
        return loss

    session.run(train_step, steps=args.steps)  # DeadPool


if __name__ == "__main__":
    main()
