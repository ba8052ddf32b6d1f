"""A typical torchrun DDP training script, written the way nanoGPT's train.py is: gradient accumulation
through DDP's `require_backward_grad_sync`, a learning-rate schedule driven by the script's own iteration
counter, the next batch drawn while the current one is in flight, and evaluation and checkpointing on
rank 0 only.

train_ddp.py is the plain script, train_ddp_deadpool.py its DeadPool port (the lines marked `# DeadPool`
are the whole change; `diff` the two):

    torchrun --standalone --nproc-per-node 2 examples/gpt/train_ddp.py --out-dir runs/ddp
    deadpool run --workers 2 --spares 1 examples/gpt/train_ddp_deadpool.py --out-dir runs/ddp-deadpool
"""

import argparse
import math
import os

import deadpool  # DeadPool
import torch
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP

from data import CharTokenizer, load_text
from model import GPT, GPTConfig

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--out-dir", default="out")
parser.add_argument("--max-iters", type=int, default=20)
parser.add_argument("--grad-accum", type=int, default=4, help="micro-steps per optimizer step")
parser.add_argument("--batch-size", type=int, default=4, help="sequences per micro-step")
parser.add_argument("--block-size", type=int, default=32)
parser.add_argument("--n-layer", type=int, default=2)
parser.add_argument("--n-head", type=int, default=2)
parser.add_argument("--n-embd", type=int, default=64)
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--min-lr", type=float, default=1e-4)
parser.add_argument("--warmup-iters", type=int, default=5)
parser.add_argument("--eval-interval", type=int, default=5)
parser.add_argument("--eval-iters", type=int, default=2)
parser.add_argument("--seed", type=int, default=1337)
args = parser.parse_args()

# -- distributed set-up: torchrun says who we are ------------------------------------------------
session = deadpool.init()  # DeadPool: under deadpool run, torchrun, or plain python (one rank)
ddp = int(os.environ.get("RANK", -1)) != -1
if ddp:
    ddp_rank = int(os.environ["RANK"])
    ddp_world_size = int(os.environ["WORLD_SIZE"])
    master_process = ddp_rank == 0  # evaluates, checkpoints and logs
    seed_offset = ddp_rank  # each rank draws different batches
else:
    ddp_rank, ddp_world_size, master_process, seed_offset = 0, 1, True, 0
torch.manual_seed(args.seed + seed_offset)
if master_process:
    os.makedirs(args.out_dir, exist_ok=True)

# -- data: real text, random windows ---------------------------------------------------------------
text = load_text()
tokenizer = CharTokenizer(text)
data = torch.tensor(tokenizer.encode(text), dtype=torch.long)
train_data, val_data = data[: int(0.9 * len(data))], data[int(0.9 * len(data)):]


def get_batch(split):
    source = train_data if split == "train" else val_data
    ix = torch.randint(len(source) - args.block_size, (args.batch_size,))
    x = torch.stack([source[i: i + args.block_size] for i in ix])
    y = torch.stack([source[i + 1: i + 1 + args.block_size] for i in ix])
    return x, y


# -- model and optimizer ---------------------------------------------------------------------------
config = GPTConfig(vocab_size=tokenizer.vocab_size, block_size=args.block_size, n_layer=args.n_layer,
                   n_head=args.n_head, n_embd=args.n_embd, dropout=0.1)
model = GPT(config)
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
if ddp:
    model = session.wrap(model)  # DeadPool
    session.register(optimizer=optimizer)  # DeadPool
raw_model = model.module if ddp else model


@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split in ("train", "val"):
        losses = torch.zeros(args.eval_iters)
        for k in range(args.eval_iters):
            x, y = get_batch(split)
            _, loss = model(x, y)
            losses[k] = loss.item()
        out[split] = losses.mean().item()
    model.train()
    return out


def get_lr(it):
    """Linear warm-up, then cosine decay to min_lr: driven by the script's own iteration counter."""
    if it < args.warmup_iters:
        return args.lr * (it + 1) / (args.warmup_iters + 1)
    ratio = (it - args.warmup_iters) / max(1, args.max_iters - args.warmup_iters)
    return args.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (args.lr - args.min_lr)


# -- training loop ---------------------------------------------------------------------------------
X, Y = get_batch("train")  # the first batch, fetched ahead
iter_num = 0
best_val_loss = 1e9
def train_step(step):  # DeadPool
    global X, Y, iter_num, best_val_loss  # DeadPool: the state the loop carries
    lr = get_lr(iter_num)
    for group in optimizer.param_groups:
        group["lr"] = lr
    if iter_num % args.eval_interval == 0 and master_process:
        losses = estimate_loss()
        print(f"iter {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}", flush=True)
        if losses["val"] < best_val_loss:
            best_val_loss = losses["val"]
            if iter_num > 0:
                checkpoint = {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                              "iter_num": iter_num, "best_val_loss": best_val_loss}
                torch.save(checkpoint, os.path.join(args.out_dir, "ckpt.pt"))
    for micro_step in range(args.grad_accum):
        if ddp:  # all-reduce the gradients only after the last micro-step
            model.require_backward_grad_sync = micro_step == args.grad_accum - 1
        _, loss = model(X, Y)
        loss = loss / args.grad_accum
        X, Y = get_batch("train")  # fetch the next batch while this one is in flight
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if master_process:
        print(f"iter {iter_num}: loss {loss.item() * args.grad_accum}, lr {lr:.3e}", flush=True)
    iter_num += 1
session.run(train_step, steps=args.max_iters)  # DeadPool

if master_process:
    torch.save(raw_model.state_dict(), os.path.join(args.out_dir, "final.pt"))
if ddp:
    destroy_process_group()
