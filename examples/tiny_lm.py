"""A custom task: a small character-level transformer language model.

Train it with a swarm::

    swarm train --task examples/tiny_lm.py:make_task

``make_task()`` trains on a few paragraphs of *Alice's Adventures in Wonderland*
(Lewis Carroll, 1865; public domain) embedded below, so it needs no download.
``make_task("corpus.txt")`` trains on a UTF-8 text file of your own; to use one
from the command line, put ``def make_my_task(): return make_task("corpus.txt")``
in a file and pass ``--task thatfile.py:make_my_task``.

The last tenth of the text is held out; ``evaluate`` reports the mean
next-character loss on it and its perplexity.

For a realistic shape, ``make_generated_task(embed=..., layers=..., ...)``
trains the same transformer on tokens generated from a seeded Markov chain
(nothing to download; every peer generates the same chain): its presets
``make_25m_task`` and ``make_50m_task`` have about 25 and 50 million
parameters::

    swarm train --task examples/tiny_lm.py:make_25m_task

``make_small_generated_task`` (0.3 million parameters) is the one whose steps
a slow link dominates (``benchmarks/loss.py``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from swarm import ConfigError
from trainer import Task, model_device, to_device

CONTEXT = 64
EMBED = 64
HEADS = 4
LAYERS = 2
HELD_OUT_FRACTION = 0.1

DEFAULT_TEXT = """\
Alice was beginning to get very tired of sitting by her sister on the bank, and of having \
nothing to do: once or twice she had peeped into the book her sister was reading, but it had \
no pictures or conversations in it, "and what is the use of a book," thought Alice "without \
pictures or conversations?"

So she was considering in her own mind (as well as she could, for the hot day made her feel \
very sleepy and stupid), whether the pleasure of making a daisy-chain would be worth the \
trouble of getting up and picking the daisies, when suddenly a White Rabbit with pink eyes \
ran close by her.

There was nothing so very remarkable in that; nor did Alice think it so very much out of the \
way to hear the Rabbit say to itself, "Oh dear! Oh dear! I shall be late!" (when she thought \
it over afterwards, it occurred to her that she ought to have wondered at this, but at the \
time it all seemed quite natural); but when the Rabbit actually took a watch out of its \
waistcoat-pocket, and looked at it, and then hurried on, Alice started to her feet, for it \
flashed across her mind that she had never before seen a rabbit with either a \
waistcoat-pocket, or a watch to take out of it, and burning with curiosity, she ran across \
the field after it, and fortunately was just in time to see it pop down a large rabbit-hole \
under the hedge.

In another moment down went Alice after it, never once considering how in the world she was \
to get out again.

The rabbit-hole went straight on like a tunnel for some way, and then dipped suddenly down, \
so suddenly that Alice had not a moment to think about stopping herself before she found \
herself falling down a very deep well.

Either the well was very deep, or she fell very slowly, for she had plenty of time as she \
went down to look about her and to wonder what was going to happen next. First, she tried to \
look down and make out what she was coming to, but it was too dark to see anything; then she \
looked at the sides of the well, and noticed that they were filled with cupboards and \
book-shelves; here and there she saw maps and pictures hung upon pegs. She took down a jar \
from one of the shelves as she passed; it was labelled "ORANGE MARMALADE", but to her great \
disappointment it was empty: she did not like to drop the jar for fear of killing somebody \
underneath, so managed to put it into one of the cupboards as she fell past it.
"""

LMBatch = tuple[torch.Tensor, torch.Tensor]


class TinyLM(nn.Module):
    """A causal transformer over tokens; output weights tied to the embedding."""

    def __init__(
        self,
        vocab_size: int,
        *,
        embed: int = EMBED,
        heads: int = HEADS,
        layers: int = LAYERS,
        context: int = CONTEXT,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, embed)
        # Small, as in GPT-2: with tied output weights, N(0, 1) would start at a huge loss.
        nn.init.normal_(self.embed.weight, std=0.02)
        self.position = nn.Parameter(torch.randn(context, embed) * 0.02)
        layer = nn.TransformerEncoderLayer(
            embed,
            heads,
            dim_feedforward=4 * embed,
            dropout=0.0,
            batch_first=True,
            norm_first=True,
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(embed)
        self.head = nn.Linear(embed, vocab_size, bias=False)
        self.head.weight = self.embed.weight
        mask = nn.Transformer.generate_square_subsequent_mask(context)
        self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of the next character at every position of ``tokens`` (batch, time)."""
        length = tokens.shape[1]
        x = self.embed(tokens) + self.position[:length]
        mask = self.get_buffer("causal_mask")[:length, :length]
        x = self.blocks(x, mask=mask, is_causal=True)
        logits: torch.Tensor = self.head(self.norm(x))
        return logits


def _windows(data: torch.Tensor, starts: torch.Tensor) -> LMBatch:
    offsets = torch.arange(CONTEXT + 1)
    chunks = data[starts[:, None] + offsets]
    return chunks[:, :-1], chunks[:, 1:]


def make_task(text_path: str | None = None) -> Task[LMBatch]:
    """The tiny language-model task on ``text_path`` (UTF-8), or on the embedded text.

    Raises ``ConfigError`` if the file cannot be read or is too short to hold out
    a validation part of at least one context window.
    """
    if text_path is None:
        text = DEFAULT_TEXT
    else:
        try:
            text = Path(text_path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read the training text {text_path}: {e}") from e
    vocabulary = sorted(set(text))
    code = {char: i for i, char in enumerate(vocabulary)}
    data = torch.tensor([code[c] for c in text], dtype=torch.int64)
    split = int(len(data) * (1 - HELD_OUT_FRACTION))
    train, held_out = data[:split], data[split:]
    if len(held_out) <= CONTEXT:
        raise ConfigError(
            f"the training text has {len(text)} characters; it needs at least "
            f"{math.ceil((CONTEXT + 1) / HELD_OUT_FRACTION)}"
        )

    def batches(seed: int, batch_size: int) -> Iterator[LMBatch]:
        generator = torch.Generator().manual_seed(seed)
        while True:
            starts = torch.randint(len(train) - CONTEXT, (batch_size,), generator=generator)
            yield _windows(train, starts)

    evaluation_starts = torch.arange(0, len(held_out) - CONTEXT, CONTEXT)

    def evaluate(model: nn.Module) -> dict[str, float]:
        return _evaluate(model, _windows(held_out, evaluation_starts))

    return Task(
        name="tiny-lm",
        make_model=lambda: TinyLM(len(vocabulary)),
        batches=batches,
        loss=_loss,
        evaluate=evaluate,
        make_optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01),
        batch_size=16,
        train_size=len(train) - CONTEXT,
    )


def _loss(model: nn.Module, batch: LMBatch) -> tuple[torch.Tensor, int]:
    """Mean next-token loss (in float32), the batch moved to the model's device."""
    inputs, targets = to_device(batch, model_device(model))
    logits = model(inputs).float()
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten()), len(inputs)


def _evaluate(model: nn.Module, batch: LMBatch) -> dict[str, float]:
    mean_loss = _loss(model, batch)[0].item()
    return {"loss": mean_loss, "perplexity": math.exp(min(mean_loss, 50.0))}


def _markov_windows(
    table: torch.Tensor, count: int, length: int, generator: torch.Generator
) -> LMBatch:
    """``count`` windows of a Markov chain: each token follows its predecessor's
    successor in ``table`` nine times in ten, and is uniform otherwise."""
    vocab = len(table)
    tokens = torch.empty(count, length + 1, dtype=torch.int64)
    tokens[:, 0] = torch.randint(vocab, (count,), generator=generator)
    for t in range(length):
        follow = torch.rand(count, generator=generator) < 0.9
        noise = torch.randint(vocab, (count,), generator=generator)
        tokens[:, t + 1] = torch.where(follow, table[tokens[:, t]], noise)
    return tokens[:, :-1], tokens[:, 1:]


def make_generated_task(
    *,
    embed: int = 512,
    heads: int = 8,
    layers: int = 8,
    context: int = 256,
    vocab: int = 8192,
    batch_size: int = 8,
    lr: float = 3e-4,
) -> Task[LMBatch]:
    """The transformer LM at a chosen shape, on generated tokens (no download).

    The chain is fixed by a seed every peer shares; each peer's ``batches``
    seed draws its own windows of it. A model that learns the chain reaches a
    loss near 0.9 * 0 + the noise's entropy share (about 1.2 nats for 8,192
    tokens) instead of ln(vocab). ``lr`` is AdamW's learning rate. Raises
    ``ConfigError`` for a shape that does not fit (heads must divide embed;
    every size positive) or a learning rate that is not positive.
    """
    if min(embed, heads, layers, context, vocab, batch_size) < 1 or embed % heads:
        raise ConfigError("every size must be positive, and heads must divide embed")
    if not lr > 0:
        raise ConfigError(f"the learning rate must be positive, got {lr}")
    table = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))
    held_out = _markov_windows(table, 16, context, torch.Generator().manual_seed(1))

    def batches(seed: int, size: int) -> Iterator[LMBatch]:
        generator = torch.Generator().manual_seed(1000 + seed)
        while True:
            yield _markov_windows(table, size, context, generator)

    return Task(
        name=f"lm-d{embed}-l{layers}-h{heads}-c{context}-v{vocab}",
        make_model=lambda: TinyLM(vocab, embed=embed, heads=heads, layers=layers, context=context),
        batches=batches,
        loss=_loss,
        evaluate=lambda model: _evaluate(model, held_out),
        make_optimizer=lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=0.01),
        batch_size=batch_size,
    )


def make_small_generated_task() -> Task[LMBatch]:
    """About 0.32 million parameters (a 1.3 MB float32 gradient): 2 layers of
    width 96, 1,024 tokens, context 64. Small enough to compute on a CPU, large
    enough that averaging it takes most of a step on a slow link (4 peers on
    20 Mbit/s: each peer sends and receives 1.5 times its gradient, 0.8 s),
    as in the packet-loss paper's runs, where steps are data-dominated
    (``benchmarks/loss.py``). Its learning rate is ten times the larger
    presets', so that a few dozen global steps already move the perplexity."""
    return make_generated_task(
        embed=96, heads=4, layers=2, context=64, vocab=1024, batch_size=8, lr=3e-3
    )


def make_25m_task() -> Task[LMBatch]:
    """About 29 million parameters: 8 layers of width 512, 8,192 tokens."""
    return make_generated_task(embed=512, heads=8, layers=8, context=256, vocab=8192)


def make_50m_task() -> Task[LMBatch]:
    """About 51 million parameters: 10 layers of width 640, 16,384 tokens."""
    return make_generated_task(embed=640, heads=10, layers=10, context=256, vocab=16384)
