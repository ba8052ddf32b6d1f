"""Tests for the GPT example model and its data pipeline."""

import ast
import math
from pathlib import Path

import pytest
import torch
from examples.gpt.data import BatchSampler, CharTokenizer, load_text, make_batch
from examples.gpt.model import GPT, GPTConfig

# Small enough that a training step takes milliseconds on one CPU core.
TINY = dict(block_size=16, n_layer=2, n_head=2, n_embd=32)


@pytest.fixture(scope="module")
def text() -> str:
    return load_text()


@pytest.fixture(scope="module")
def tokenizer(text: str) -> CharTokenizer:
    return CharTokenizer(text)


@pytest.fixture(scope="module")
def tokens(text: str, tokenizer: CharTokenizer) -> torch.Tensor:
    return torch.tensor(tokenizer.encode(text), dtype=torch.long)


def first_batch(
    tokens: torch.Tensor, block_size: int, batch_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first batch a single-rank run would train on."""
    sampler = BatchSampler(
        num_tokens=len(tokens),
        block_size=block_size,
        batch_size=batch_size,
        rank=0,
        world_size=1,
        seed=0,
    )
    return make_batch(tokens, sampler.next_batch(), block_size)


def train(model: GPT, x: torch.Tensor, y: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Run AdamW steps on one batch and return the loss of each step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        _, loss = model(x, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return losses


# --- model ---------------------------------------------------------------------------------


def test_config_rejects_embedding_not_divisible_by_heads() -> None:
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(vocab_size=10, n_embd=30, n_head=4)


@pytest.mark.parametrize(
    "bad", [dict(vocab_size=0), dict(vocab_size=10, n_layer=0), dict(vocab_size=10, dropout=1.0)]
)
def test_config_rejects_invalid_values(bad: dict) -> None:
    with pytest.raises(ValueError):
        GPTConfig(**bad)


def test_default_parameter_count(tokenizer: CharTokenizer) -> None:
    config = GPTConfig(vocab_size=tokenizer.vocab_size)
    V, T, C, L = config.vocab_size, config.block_size, config.n_embd, config.n_layer
    # Embeddings (lm_head is tied, so counted once) + per block: qkv, attention projection,
    # MLP in/out with biases (12C^2 + 9C) and two LayerNorms (4C) + the final LayerNorm.
    expected = V * C + T * C + L * (12 * C * C + 13 * C) + 2 * C
    n = GPT(config).num_parameters()
    assert n == expected
    assert 2_500_000 < n < 3_500_000


def test_initial_loss_is_close_to_uniform(tokens: torch.Tensor, tokenizer: CharTokenizer) -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tokenizer.vocab_size)).eval()
    x, y = first_batch(tokens, block_size=64, batch_size=4)
    with torch.no_grad():
        logits, loss = model(x, y)
    assert logits.shape == (4, 64, tokenizer.vocab_size)
    assert loss is not None
    assert abs(loss.item() - math.log(tokenizer.vocab_size)) < 0.3


def test_forward_without_targets_returns_no_loss(tokenizer: CharTokenizer) -> None:
    model = GPT(GPTConfig(vocab_size=tokenizer.vocab_size, **TINY))
    logits, loss = model(torch.zeros(2, 5, dtype=torch.long))
    assert logits.shape == (2, 5, tokenizer.vocab_size)
    assert loss is None


def test_forward_rejects_sequence_longer_than_block_size() -> None:
    model = GPT(GPTConfig(vocab_size=10, **TINY))
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, TINY["block_size"] + 1, dtype=torch.long))


def test_attention_is_causal(tokens: torch.Tensor, tokenizer: CharTokenizer) -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tokenizer.vocab_size, **TINY)).eval()
    x, _ = first_batch(tokens, block_size=16, batch_size=2)
    changed = x.clone()
    changed[:, -1] = (changed[:, -1] + 1) % tokenizer.vocab_size
    with torch.no_grad():
        before, _ = model(x)
        after, _ = model(changed)
    # Changing the last token may only change the prediction at the last position.
    torch.testing.assert_close(before[:, :-1], after[:, :-1], rtol=0, atol=1e-6)
    assert not torch.allclose(before[:, -1], after[:, -1])


def test_same_seed_gives_bit_identical_training(
    tokens: torch.Tensor, tokenizer: CharTokenizer
) -> None:
    x, y = first_batch(tokens, block_size=16, batch_size=4)
    runs = []
    for _ in range(2):
        torch.manual_seed(1234)  # seeds both initialisation and dropout
        model = GPT(GPTConfig(vocab_size=tokenizer.vocab_size, **TINY))
        losses = train(model, x, y, steps=3)
        runs.append((losses, model.state_dict()))
    (losses_a, state_a), (losses_b, state_b) = runs
    for a, b in zip(losses_a, losses_b):
        assert torch.equal(a, b)
    for name in state_a:
        assert torch.equal(state_a[name], state_b[name]), name


def test_training_reduces_loss(tokens: torch.Tensor, tokenizer: CharTokenizer) -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tokenizer.vocab_size, dropout=0.0, **TINY))
    x, y = first_batch(tokens, block_size=16, batch_size=8)
    losses = train(model, x, y, steps=40)
    assert losses[-1].item() < losses[0].item() - 1.0


# --- data ----------------------------------------------------------------------------------


def test_default_text_is_long_real_text(text: str) -> None:
    assert len(text) > 100_000
    assert "Python" in text
    assert load_text() == text  # same text on every call, hence on every machine


def test_load_text_from_file(tmp_path: Path) -> None:
    path = tmp_path / "corpus.txt"
    content = "héllo wörld\n" * 1_000
    path.write_text(content, encoding="utf-8")
    assert load_text(str(path)) == content


def test_load_text_rejects_missing_or_short_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not found"):
        load_text(str(tmp_path / "missing.txt"))
    short = tmp_path / "short.txt"
    short.write_text("too short", encoding="utf-8")
    with pytest.raises(ValueError, match="at least"):
        load_text(str(short))


def test_tokenizer_roundtrip(text: str, tokenizer: CharTokenizer) -> None:
    assert tokenizer.vocab == sorted(set(text))
    assert tokenizer.vocab_size == len(tokenizer.vocab)
    sample = text[:5_000]
    ids = tokenizer.encode(sample)
    assert all(0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.decode(ids) == sample


def test_tokenizer_rejects_unknown_characters() -> None:
    with pytest.raises(ValueError, match="not in vocabulary"):
        CharTokenizer("abc").encode("abd")


def test_make_batch_cuts_windows_and_shifted_targets() -> None:
    tokens = torch.arange(100)
    x, y = make_batch(tokens, [3, 0], block_size=8)
    assert x.dtype == y.dtype == torch.long
    assert x.tolist() == [list(range(24, 32)), list(range(0, 8))]
    assert y.tolist() == [list(range(25, 33)), list(range(1, 9))]


def test_make_batch_puts_the_batch_on_the_given_device() -> None:
    x, y = make_batch(torch.arange(100), [3, 0], block_size=8, device=torch.device("meta"))
    assert x.device.type == y.device.type == "meta" and x.shape == y.shape == (2, 8)


def test_the_example_trains_on_batches_on_the_sessions_device() -> None:
    """On a GPU the model lives on session.device: every batch the training step builds must go there too
    (a CPU batch would fail at step 1, and be replayed on a spare into the same error)."""
    tree = ast.parse((Path(__file__).parents[2] / "examples" / "gpt" / "train.py").read_text())
    [step] = [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "train_step"]
    calls = [c for c in ast.walk(step) if isinstance(c, ast.Call) and getattr(c.func, "id", "") == "make_batch"]
    assert calls and all(ast.unparse(c.args[3]) == "session.device" for c in calls)


# The sampler tests use 100 samples and a global batch of 4 x 3 = 12:
# 8 steps per epoch, the last 4 ids of each epoch are dropped.
NUM_TOKENS, BLOCK, BATCH, WORLD = 1_001, 10, 4, 3
STEPS_PER_EPOCH = 8


def make_samplers(seed: int = 7) -> list[BatchSampler]:
    return [
        BatchSampler(
            num_tokens=NUM_TOKENS,
            block_size=BLOCK,
            batch_size=BATCH,
            rank=rank,
            world_size=WORLD,
            seed=seed,
        )
        for rank in range(WORLD)
    ]


def test_sampler_ranks_get_disjoint_ids_in_a_step() -> None:
    samplers = [
        BatchSampler(
            num_tokens=NUM_TOKENS, block_size=BLOCK, batch_size=5, rank=r, world_size=4, seed=0
        )
        for r in range(4)
    ]
    batches = [s.next_batch() for s in samplers]
    assert all(len(b) == 5 for b in batches)
    assert len(set().union(*batches)) == 20


def test_sampler_epoch_covers_all_samples_but_the_dropped_remainder() -> None:
    samplers = make_samplers()
    assert samplers[0].num_samples == 100
    seen: list[int] = []
    for _ in range(STEPS_PER_EPOCH):
        for sampler in samplers:
            seen.extend(sampler.next_batch())
    assert len(seen) == len(set(seen)) == STEPS_PER_EPOCH * BATCH * WORLD
    assert set(seen) <= set(range(100))
    # The ids seen are exactly the epoch's permutation without its last 4 entries.
    permutation = torch.randperm(100, generator=torch.Generator().manual_seed(7 * 1_000_003))
    assert seen == permutation[:96].tolist()
    assert samplers[0].state_dict() == {"epoch": 0, "cursor": 96}
    # The next step starts the next epoch, in a different order.
    samplers[0].next_batch()
    assert samplers[0].state_dict() == {"epoch": 1, "cursor": 12}


def test_sampler_resumes_exactly_across_an_epoch_boundary() -> None:
    original = make_samplers()[1]
    for _ in range(5):
        original.next_batch()
    state = original.state_dict()
    assert all(type(v) is int for v in state.values())
    # 16 steps from step 5 cross two epoch boundaries.
    expected = [original.next_batch() for _ in range(2 * STEPS_PER_EPOCH)]

    resumed = make_samplers()[1]
    resumed.next_batch()  # a different position, which loading must replace
    resumed.load_state_dict(state)
    assert [resumed.next_batch() for _ in range(2 * STEPS_PER_EPOCH)] == expected

    # Loading a later epoch into a sampler that cached an earlier one recomputes the order.
    later = make_samplers()[1]
    later.next_batch()
    later.load_state_dict(original.state_dict())
    assert later.next_batch() == original.next_batch()
    assert original.epoch == 2


@pytest.mark.parametrize(
    "state",
    [
        {"epoch": 0},
        {"epoch": 0, "cursor": 0, "extra": 1},
        {"epoch": -1, "cursor": 0},
        {"epoch": 0, "cursor": 101},
        {"epoch": 0, "cursor": 1.0},
        {"epoch": True, "cursor": 0},
    ],
)
def test_sampler_load_state_dict_rejects_bad_state(state: dict) -> None:
    with pytest.raises(ValueError):
        make_samplers()[0].load_state_dict(state)


def test_sampler_rejects_data_too_small_for_one_global_batch() -> None:
    with pytest.raises(ValueError, match="global batch"):
        BatchSampler(num_tokens=50, block_size=10, batch_size=2, rank=0, world_size=4, seed=0)
