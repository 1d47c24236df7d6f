"""Pre-train a tiny causal language model on packed sequences, with exact resume.

    python examples/lm_pack.py                          # synthetic corpus, ~1 min on 2 cores
    python examples/lm_pack.py --resume                 # continue exactly where it stopped
    python examples/lm_pack.py --data train.jsonl --seq-len 1024 --num-workers 4

The pipeline:

    StreamingJsonl(train, shuffle=True)     raw records, shuffled by block and buffer
      .map(Tokenize(tokenizer))             -> {"input_ids": [...]}, in the DataLoader workers
      .pack(PackTokens(seq_len, eos_id))    -> input_ids, position_ids, document_ids: exactly
                                               seq_len tokens each, documents split at the ends
    StatefulDataLoader(batch_size=B)        -> [B, seq_len] LongTensors

Attention stays within each document (`streamds.document_mask`), positions restart at each
document, and the loss skips the step from one document to the next. Every `--ckpt-every`
steps the model, optimizer, RNG states and the loader's state (which holds the unused tokens
of the document the last sequence ended in) go into ``OUT/checkpoint.pt``; ``--resume``
continues with exactly the sequences the uninterrupted run would have seen (``--log-ids``
logs a digest of each step's tokens to check it).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import random
import sys
import time
from collections.abc import Iterator, Sequence
from itertools import islice
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # we fork DataLoader workers
# torch keeps its threads (one per CPU: a second thread speeds the step more than it takes from
# the workers), but they wait for work asleep instead of spinning, so between operations they
# leave the CPUs to the workers and to other programs where the CPUs are shared (spinning
# threads there slow every step several times over). Read once, when torch loads; on a machine
# of your own, OMP_WAIT_POLICY=ACTIVE exported before the run spins for a little more speed.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from torch import nn

from streamds import PackTokens, StreamingJsonl, document_mask, stateful_loader, token_counts

CHECKPOINT = "checkpoint.pt"
SPECIALS = ["[PAD]", "[UNK]", "[EOS]"]  # ids 0, 1, 2
PAD_ID, EOS_ID = 0, 2
# Arguments that must match for --resume to continue the same run
RUN_IDENTITY = ("data", "seed", "seq_len", "batch_size", "num_workers", "shuffle_buffer",
                "vocab_size", "d_model", "layers", "records")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=None, help="JSONL source (PubMed/arXiv layout); default: "
                   "a synthetic corpus")
    p.add_argument("--out", default="data/lm_pack", help="corpus, tokenizer, checkpoint")
    p.add_argument("--records", type=int, default=2000, help="synthetic corpus size")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--num-workers", type=int, default=1)
    p.add_argument("--shuffle-buffer", type=int, default=256)
    p.add_argument("--vocab-size", type=int, default=2000)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="use this tokenizer.json instead of training one")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    p.add_argument("--stop-after", type=int, default=None, metavar="K",
                   help="checkpoint and exit after step K (simulates an interruption)")
    p.add_argument("--log-ids", default=None, metavar="PATH",
                   help="write {step, digest, loss} per step to this JSON-lines file")
    p.add_argument("--throttle", type=float, default=0.0, metavar="SECONDS",
                   help="sleep this long after each step (tests kill a run mid-way)")
    p.add_argument("--quiet", action="store_true")
    return p


# -- data ---------------------------------------------------------------------------------------


def text_of(record: dict[str, Any]) -> str:
    return " ".join(record["article_text"])


def corpus_source(args: argparse.Namespace, out: Path) -> str:
    if args.data is not None:
        return args.data
    from streamds.tools.synthetic import write_pubmed_splits

    directory = out / "corpus"
    marker = directory / "corpus.txt"
    spec = f"records={args.records} seed={args.seed}\n"
    if not (marker.exists() and marker.read_text() == spec):
        write_pubmed_splits(directory, train_records=args.records, val_records=0,
                            test_records=0, seed=args.seed, record_chars=1500)
        marker.write_text(spec)
    return str(directory / "train.txt")


def train_tokenizer(source: str, path: Path, *, vocab_size: int, records: int = 500) -> None:
    """A WordPiece tokenizer learned from the first `records` streamed records."""
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                        show_progress=False)
    texts: Iterator[str] = iter(StreamingJsonl(source).map(text_of))
    tokenizer.train_from_iterator(islice(texts, records), trainer=trainer, length=records)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))


@functools.cache
def _load(path: str) -> Tokenizer:
    return Tokenizer.from_file(path)


class Tokenize:
    """record -> {"input_ids": [...]}; pickles as its path, loads the tokenizer once per
    process."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __call__(self, record: dict[str, Any]) -> dict[str, Any]:
        return {"input_ids": _load(self.path).encode(text_of(record)).ids}


# -- model --------------------------------------------------------------------------------------


class TinyLM(nn.Module):
    """A causal transformer whose attention stays within documents."""

    def __init__(self, vocab: int, *, d_model: int, layers: int, max_len: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.position = nn.Embedding(max_len, d_model)
        layer = nn.TransformerEncoderLayer(d_model, nhead=4, dim_feedforward=2 * d_model,
                                           dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        x = self.embed(batch["input_ids"]) + self.position(batch["position_ids"])
        allowed = document_mask(batch["document_ids"])  # [B, L, L]
        allowed |= torch.eye(allowed.shape[-1], dtype=torch.bool)  # padding sees itself
        blocked = (~allowed).repeat_interleave(self.blocks.layers[0].self_attn.num_heads, 0)
        return self.head(self.blocks(x, mask=blocked))


def lm_loss(model: TinyLM, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Next-token loss, skipping the last token of each document piece and padding."""
    logits = model(batch)[:, :-1]
    targets = batch["input_ids"][:, 1:]
    documents = batch["document_ids"]
    same = (documents[:, 1:] == documents[:, :-1]) & (documents[:, 1:] >= 0)
    loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                       targets.reshape(-1), reduction="none")
    return (loss * same.reshape(-1)).sum() / same.sum().clamp(min=1)


# -- the run ------------------------------------------------------------------------------------


def digest(batch: dict[str, torch.Tensor]) -> str:
    return hashlib.blake2b(batch["input_ids"].numpy().tobytes(), digest_size=8).hexdigest()


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    say = (lambda *_: None) if args.quiet else functools.partial(print, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    identity = {key: getattr(args, key) for key in RUN_IDENTITY}
    checkpoint_path = out / CHECKPOINT
    checkpoint = None
    if args.resume and checkpoint_path.exists():
        checkpoint = torch.load(checkpoint_path, map_location="cpu", weights_only=True)
        if checkpoint["identity"] != identity:
            changed = sorted(k for k in RUN_IDENTITY if checkpoint["identity"][k] != identity[k])
            raise SystemExit(f"--resume: these arguments differ from the checkpoint's run: "
                             f"{changed}; pass the same ones or start a new --out")

    source = corpus_source(args, out)
    tokenizer_path = out / "tokenizer.json"
    if args.tokenizer is not None and checkpoint is None:
        Tokenizer.from_file(args.tokenizer).save(str(tokenizer_path))
    elif checkpoint is None or not tokenizer_path.exists():
        train_tokenizer(source, tokenizer_path, vocab_size=args.vocab_size)
    vocab = Tokenizer.from_file(str(tokenizer_path)).get_vocab_size()

    # -> records, shuffled -> {"input_ids"} in the workers -> packed sequences of seq_len
    packed = (StreamingJsonl(source, shuffle=True, seed=args.seed,
                             buffer_size=args.shuffle_buffer)
              .map(Tokenize(tokenizer_path))
              .pack(PackTokens(args.seq_len, EOS_ID, pad_id=PAD_ID)))
    loader = stateful_loader(packed, batch_size=args.batch_size,
                             num_workers=args.num_workers)
    model = TinyLM(vocab, d_model=args.d_model, layers=args.layers, max_len=args.seq_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    step, epoch, tokens_seen = 0, 0, 0
    if checkpoint is not None:
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        loader.load_state_dict(checkpoint["loader"])
        step, epoch, tokens_seen = checkpoint["step"], checkpoint["epoch"], checkpoint["tokens"]
        torch.set_rng_state(checkpoint["rng"])
        say(f"resumed from {checkpoint_path} at step {step} (epoch {epoch})")
    id_log = Path(args.log_ids) if args.log_ids else None
    if id_log is not None:
        kept = id_log.read_text().splitlines() if checkpoint and id_log.exists() else []
        id_log.write_text("".join(line + "\n" for line in kept
                                  if line.endswith("}") and json.loads(line)["step"] <= step))

    def save() -> None:
        tmp = checkpoint_path.with_name(CHECKPOINT + ".tmp")
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "loader": loader.state_dict(), "step": step, "epoch": epoch,
                    "tokens": tokens_seen, "rng": torch.get_rng_state(),
                    "identity": identity}, tmp)
        os.replace(tmp, checkpoint_path)  # a kill mid-save leaves the previous checkpoint

    started, start_tokens, losses = time.perf_counter(), tokens_seen, []
    stopped = False
    while step < args.steps and not stopped:
        loader.dataset.set_epoch(epoch)
        for batch in loader:
            loss = lm_loss(model, batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            tokens_seen += int((batch["document_ids"] >= 0).sum())
            losses.append(loss.item())
            if id_log is not None:
                with id_log.open("a") as f:
                    f.write(json.dumps({"step": step, "digest": digest(batch),
                                        "loss": losses[-1]}) + "\n")
            if step % 25 == 0:
                say(f"step {step:5d}  loss {sum(losses[-25:]) / len(losses[-25:]):6.3f}")
            if args.throttle:
                time.sleep(args.throttle)
            if step % args.ckpt_every == 0 or step in (args.stop_after, args.steps):
                save()
            if step == args.stop_after:
                stopped = True
                break
            if step >= args.steps:
                break
        else:
            epoch += 1
    seconds = time.perf_counter() - started
    counts = token_counts(loader.state_dict())
    summary = {"steps": step, "epoch": epoch, "stopped_early": stopped,
               "tokens_per_s": (tokens_seen - start_tokens) / seconds if seconds else 0.0,
               "first_loss": losses[0] if losses else None,
               "last_loss": losses[-1] if losses else None, "packing": counts}
    (out / "results.json").write_text(json.dumps(summary, indent=2))
    say(f"{step} steps, {summary['tokens_per_s']:.0f} tokens/s; packing this epoch so far: "
        f"{counts['packed']} tokens in {counts['sequences']} sequences, "
        f"{counts['padded']} padding")
    return summary


if __name__ == "__main__":
    main()
