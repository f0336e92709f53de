"""Train a tiny character-level language model with a tied head and per-task adapters.

The model shows the two utilities of ``toolkit.nn`` working together:

* its output head is a :class:`toolkit.nn.TiedLinear` that reads the token embedding's weight,
  so the head adds no parameters and the state dict holds that weight once;
* each task (prose, verse, questions and answers: the files in ``examples/corpus/``) gets its
  own small residual adapter, held in a :class:`toolkit.nn.ModuleDefaultDict` that creates
  an adapter the first time a task name is used.

The script trains on the CPU for a few hundred steps and prints the loss falling and the
parameters saved by tying. It then saves the weights with safetensors, builds a fresh model
whose adapter dict is empty, restores the checkpoint with ``load_state_dict(strict=True)``
(loading creates the adapters it names), and checks that both models give identical outputs
for every task. Any failed check ends the script with a non-zero exit status.

Run it from the repository root with::

    nox -s example                      # installs toolkit-nn and safetensors, then runs this
    nox -s example -- --steps 600 --out ckpt

or, where both are installed, ``python examples/tiny_lm.py --help``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from toolkit.nn import ModuleDefaultDict, TiedLinear

CORPUS_DIR = Path(__file__).parent / "corpus"


class CheckFailedError(Exception):
    """A check of the example did not hold."""


def check(condition: bool, message: str) -> None:
    """Raise :class:`CheckFailedError` with ``message`` unless ``condition`` holds.

    Unlike ``assert``, the check still runs under ``python -O``.
    """
    if not condition:
        raise CheckFailedError(message)


@dataclasses.dataclass(frozen=True)
class Config:
    """The shape of a :class:`TinyLM`; saved next to the checkpoint as JSON.

    Attributes:
        vocab: Every character the model knows, in token-id order.
        dim: The width of the embedding and of the blocks.
        context: The longest sequence the model reads.
        layers: The number of transformer blocks.
        heads: The number of attention heads per block.
        adapter_rank: The bottleneck width of each task adapter.
    """

    vocab: str
    dim: int = 64
    context: int = 64
    layers: int = 2
    heads: int = 4
    adapter_rank: int = 16


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention, then an MLP, each residual.

    Args:
        dim: The model width.
        heads: The number of attention heads; must divide ``dim``.
    """

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: Tensor) -> Tensor:
        """Map ``(batch, seq, dim)`` to the same shape; position ``t`` sees ``0..t`` only."""
        batch, seq, dim = x.shape
        qkv = self.qkv(self.norm1(x)).view(batch, seq, 3, self.heads, dim // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, seq, dim))
        out: Tensor = x + self.mlp(self.norm2(x))
        return out


class Adapter(nn.Module):
    """A residual bottleneck ``x + up(gelu(down(x)))`` that starts as the identity.

    Args:
        dim: The model width.
        rank: The bottleneck width.
    """

    def __init__(self, dim: int, rank: int) -> None:
        super().__init__()
        self.down = nn.Linear(dim, rank)
        self.up = nn.Linear(rank, dim)
        nn.init.zeros_(self.up.weight)
        nn.init.zeros_(self.up.bias)

    def forward(self, x: Tensor) -> Tensor:
        """Add the adapter's correction to ``x``."""
        out: Tensor = x + self.up(F.gelu(self.down(x)))
        return out


class TinyLM(nn.Module):
    """Embedding, transformer blocks, a per-task adapter, and a head tied to the embedding.

    Args:
        config: The model's shape.
        tied: If False, use a separate ``nn.Linear`` head instead of the tied one; only
            used to count what tying saves.
    """

    def __init__(self, config: Config, *, tied: bool = True) -> None:
        super().__init__()
        vocab, dim = len(config.vocab), config.dim
        self.embed = nn.Embedding(vocab, dim)
        nn.init.normal_(self.embed.weight, std=dim**-0.5)  # logits start near unit scale
        self.pos = nn.Parameter(torch.zeros(config.context, dim))
        self.blocks = nn.ModuleList(Block(dim, config.heads) for _ in range(config.layers))
        # A class or a functools.partial is a picklable factory; a lambda would not be.
        self.adapters = ModuleDefaultDict(functools.partial(Adapter, dim, config.adapter_rank))
        self.norm = nn.LayerNorm(dim)
        # TiedLinear is not an nn.Module, so it registers nothing: the embedding owns the
        # only copy of the weight. The nn.Linear alternative is registered and owns its own.
        self.head: TiedLinear | nn.Linear = (
            TiedLinear(self.embed) if tied else nn.Linear(dim, vocab, bias=False)
        )

    def forward(self, tokens: Tensor, task: str) -> Tensor:
        """Return next-token logits of shape ``(batch, seq, vocab)`` for ``task``.

        The first call with a new ``task`` creates its adapter.
        """
        h = self.embed(tokens) + self.pos[: tokens.shape[-1]]
        for block in self.blocks:
            h = block(h)
        h = self.adapters[task](h)
        logits: Tensor = self.head(self.norm(h))
        return logits


def count_parameters(module: nn.Module) -> int:
    """The number of distinct scalars among ``module.parameters()``."""
    return sum(p.numel() for p in module.parameters())


def load_corpus() -> tuple[str, dict[str, Tensor]]:
    """Read every ``corpus/*.txt`` as one task and encode it as character ids.

    Returns:
        The vocabulary (every character of the corpus, sorted, in id order) and, for each
        task name (the file's stem), its token ids.
    """
    texts = {
        path.stem: path.read_text(encoding="utf-8") for path in sorted(CORPUS_DIR.glob("*.txt"))
    }
    check(bool(texts), f"no corpus files found in {CORPUS_DIR}")
    vocab = "".join(sorted(set("".join(texts.values()))))
    ids = {char: i for i, char in enumerate(vocab)}
    return vocab, {task: torch.tensor([ids[c] for c in text]) for task, text in texts.items()}


def windows(data: Tensor, starts: Tensor, length: int) -> tuple[Tensor, Tensor]:
    """Cut inputs ``data[s : s + length]`` and their next-token targets at each start."""
    offsets = starts[:, None] + torch.arange(length + 1)
    chunk = data[offsets]
    return chunk[:, :-1], chunk[:, 1:]


@torch.no_grad()
def evaluate(model: TinyLM, batches: dict[str, tuple[Tensor, Tensor]]) -> float:
    """Mean cross-entropy over the fixed evaluation windows of every task."""
    model.eval()
    losses = [
        F.cross_entropy(model(x, task).flatten(0, 1), y.flatten()).item()
        for task, (x, y) in batches.items()
    ]
    model.train()
    return sum(losses) / len(losses)


@torch.no_grad()
def sample(model: TinyLM, config: Config, prompt: str, task: str, length: int, seed: int) -> str:
    """Continue ``prompt`` by ``length`` characters, sampled at temperature 0.7 with a seed."""
    model.eval()
    ids = {char: i for i, char in enumerate(config.vocab)}
    tokens = torch.tensor([[ids[c] for c in prompt]])
    generator = torch.Generator().manual_seed(seed)
    for _ in range(length):
        logits = model(tokens[:, -config.context :], task)[0, -1]
        probs = F.softmax(logits / 0.7, dim=-1)
        next_id = torch.multinomial(probs, 1, generator=generator)
        tokens = torch.cat([tokens, next_id[None]], dim=1)
    return "".join(config.vocab[i] for i in tokens[0].tolist())


def train(args: argparse.Namespace) -> tuple[TinyLM, Config, dict[str, Tensor]]:
    """Train a model on every task in turn and check that the loss fell.

    Returns:
        The trained model, its config, and the corpus it was trained on.
    """
    vocab, data = load_corpus()
    config = Config(vocab=vocab)
    tasks = list(data)
    print(f"corpus: {', '.join(f'{t} ({len(d)} chars)' for t, d in data.items())}")
    print(f"vocabulary: {len(vocab)} characters")

    torch.manual_seed(args.seed)
    model = TinyLM(config)
    for task in tasks:  # The optimizer must see every adapter, so create them up front.
        model.adapters[task]
    print(f"adapters created on first use: {list(model.adapters)}")

    untied = TinyLM(config, tied=False)
    for task in tasks:
        untied.adapters[task]
    saved = count_parameters(untied) - count_parameters(model)
    print(
        f"parameters: {count_parameters(model):,} with the tied head, "
        f"{count_parameters(untied):,} with an nn.Linear head; tying saves {saved:,} "
        f"(vocab {len(vocab)} x dim {config.dim})"
    )
    check(saved == len(vocab) * config.dim, f"tying saved {saved} parameters, not vocab x dim")
    check(model.head.weight is model.embed.weight, "the head does not read the embedding's weight")

    generator = torch.Generator().manual_seed(args.seed)
    eval_batches = {
        task: windows(
            d, torch.randint(len(d) - config.context, (16,), generator=generator), config.context
        )
        for task, d in data.items()
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    first = evaluate(model, eval_batches)
    print("loss: mean cross-entropy over 16 fixed windows per task, in nats per character")
    print(f"step {0:4d}  loss {first:.3f}  (a uniform guess scores {math.log(len(vocab)):.3f})")
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        task = tasks[step % len(tasks)]
        d = data[task]
        starts = torch.randint(len(d) - config.context, (args.batch,), generator=generator)
        x, y = windows(d, starts, config.context)
        loss = F.cross_entropy(model(x, task).flatten(0, 1), y.flatten())
        optimizer.zero_grad(set_to_none=True)
        torch.autograd.backward(loss)  # loss.backward(), which torch leaves unannotated
        optimizer.step()
        if step % max(1, args.steps // 8) == 0 or step == args.steps:
            print(f"step {step:4d}  loss {evaluate(model, eval_batches):.3f}")
    last = evaluate(model, eval_batches)
    print(f"trained {args.steps} steps in {time.perf_counter() - start:.1f} s")
    check(
        last < first / 2,
        f"the loss did not fall enough: {first:.3f} -> {last:.3f} (needed < {first / 2:.3f}); "
        "train for more --steps",
    )
    return model, config, data


def restore_and_compare(
    model: TinyLM, config: Config, data: dict[str, Tensor], out: Path
) -> TinyLM:
    """Save ``model`` to ``out``, restore it into a fresh model, and check that they agree.

    Returns:
        The restored model.
    """
    out.mkdir(parents=True, exist_ok=True)
    weights, config_file = out / "model.safetensors", out / "config.json"
    # One key per tensor and no shared storage: the tied head adds nothing to the state dict.
    try:
        save_file(model.state_dict(), weights)
    except ModuleNotFoundError as error:  # safetensors.torch saves through numpy
        raise CheckFailedError(
            f"safetensors could not save: {error}; install safetensors[torch], which brings numpy"
        ) from error
    config_file.write_text(json.dumps(dataclasses.asdict(config)), encoding="utf-8")
    print(
        f"saved {len(model.state_dict())} tensors to {weights} ({weights.stat().st_size:,} bytes)"
    )

    fresh = TinyLM(Config(**json.loads(config_file.read_text(encoding="utf-8"))))
    print(f"fresh model adapters before loading: {list(fresh.adapters)}")
    try:
        fresh.load_state_dict(load_file(weights), strict=True)
    except RuntimeError as error:
        raise CheckFailedError(f"strict loading into a fresh model failed: {error}") from error
    print(f"fresh model adapters after loading:  {list(fresh.adapters)} (created by loading)")
    check(list(fresh.adapters) == list(model.adapters), "loading did not create every adapter")
    check(fresh.head.weight is fresh.embed.weight, "the fresh head is not tied to its embedding")

    model.eval()
    fresh.eval()
    with torch.no_grad():
        for task, d in data.items():
            # Every whole window of the task's text, side by side.
            x, _ = windows(
                d, torch.arange(0, len(d) - config.context, config.context), config.context
            )
            same = torch.equal(model(x, task), fresh(x, task))
            print(f"  {task:>6}: logits on {x.shape[0]} windows identical: {same}")
            check(
                same, f"the restored model's outputs differ from the trained model's for {task!r}"
            )
    check(list(fresh.adapters) == list(model.adapters), "comparing outputs created an adapter")
    return fresh


def main(argv: list[str] | None = None) -> int:
    """Train, report, save, restore and compare; return the process exit status.

    Args:
        argv: Command-line arguments; ``sys.argv[1:]`` when None.

    Returns:
        0 when every check holds, 1 otherwise.
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=400, help="training steps (default 400)")
    parser.add_argument("--batch", type=int, default=32, help="windows per step (default 32)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument(
        "--out", type=Path, help="folder for the checkpoint (default: a temporary one)"
    )
    parser.add_argument(
        "--sample", type=int, default=60, help="characters to generate per task (0: none)"
    )
    parser.add_argument("--threads", type=int, default=1, help="CPU threads for torch (default 1)")
    args = parser.parse_args(argv)
    if min(args.steps, args.batch, args.threads) < 1:
        parser.error("--steps, --batch and --threads must be positive")
    # A model this small runs fastest on one thread, and keeps that speed when other jobs
    # share the cores; more threads mostly wait for each other.
    torch.set_num_threads(args.threads)

    try:
        model, config, data = train(args)
        if args.out is not None:
            restored = restore_and_compare(model, config, data, args.out)
        else:
            with tempfile.TemporaryDirectory() as tmp:
                restored = restore_and_compare(model, config, data, Path(tmp))
    except CheckFailedError as error:
        print(f"FAILED: {error}", file=sys.stderr)
        return 1

    if args.sample > 0:
        print("samples from the restored model:")
        prompts = {"prose": "The ", "verse": "The ", "qa": "Q: "}
        for task in data:
            text = sample(restored, config, prompts.get(task, "The "), task, args.sample, args.seed)
            print(f"--- {task} ---\n{text}")
    print("all checks passed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
