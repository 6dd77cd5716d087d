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
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from swarm import ConfigError
from trainer import Task

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
    """A causal transformer over characters; output weights tied to the embedding."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, EMBED)
        # Small, as in GPT-2: with tied output weights, N(0, 1) would start at a huge loss.
        nn.init.normal_(self.embed.weight, std=0.02)
        self.position = nn.Parameter(torch.randn(CONTEXT, EMBED) * 0.02)
        layer = nn.TransformerEncoderLayer(
            EMBED,
            HEADS,
            dim_feedforward=4 * EMBED,
            dropout=0.0,
            batch_first=True,
            norm_first=True,
        )
        self.blocks = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(EMBED)
        self.head = nn.Linear(EMBED, vocab_size, bias=False)
        self.head.weight = self.embed.weight
        mask = nn.Transformer.generate_square_subsequent_mask(CONTEXT)
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

    def loss(model: nn.Module, batch: LMBatch) -> tuple[torch.Tensor, int]:
        inputs, targets = batch
        logits = model(inputs)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten()), len(inputs)

    evaluation_starts = torch.arange(0, len(held_out) - CONTEXT, CONTEXT)

    def evaluate(model: nn.Module) -> dict[str, float]:
        inputs, targets = _windows(held_out, evaluation_starts)
        logits = model(inputs)
        mean_loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()
        return {"loss": mean_loss, "perplexity": math.exp(min(mean_loss, 50.0))}

    return Task(
        name="tiny-lm",
        make_model=lambda: TinyLM(len(vocabulary)),
        batches=batches,
        loss=loss,
        evaluate=evaluate,
        make_optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01),
        batch_size=16,
        train_size=len(train) - CONTEXT,
    )
