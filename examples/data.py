"""Real text with no download, for the examples: the Python standard library's own source files.

Every machine that runs Python has them, so ``make train`` learns something a person can judge (code) without a
data set to fetch. The pieces, each usable alone:

* :func:`stdlib_files` -- the corpus: the sorted ``*.py`` files at the top of ``sysconfig.get_paths()["stdlib"]``,
  split by file into train and validation (every ``val_every``-th file is held out: disjoint files, so no line of a
  validation file was trained on), each split capped at a number of bytes (a deterministic prefix of that list).
* :func:`tokenizer` -- a byte-level BPE from Hugging Face ``tokenizers``, trained on the train split once and cached
  as JSON in the cache directory (keyed by the vocabulary size and a digest of the files' names and sizes).
* :func:`encode` -- a split as one 1-D int32 tensor of token ids (cached beside the tokenizer).
* :class:`Windows` -- a map-style ``Dataset`` of non-overlapping ``seq + 1`` token windows, item ``i`` is
  ``(x, y)`` with ``y`` the next tokens; :func:`loader` wraps it in a ``DataLoader`` with a ``DistributedSampler``,
  so each rank reads its own slice of every epoch (a reshuffle per epoch: ``sampler.set_epoch``), and
  :func:`train_batches` resumes that stream at any step.
* :func:`unigram_entropy` -- the baseline a language model must beat: the entropy (nats/token, the loss's unit) of
  the validation tokens' own unigram distribution, what a model that ignores the context at best achieves.

With several ranks, rank 0 builds the cache and the others wait at a barrier (``prepare``).
"""
from __future__ import annotations

import glob
import hashlib
import itertools
import json
import math
import os
import sysconfig
from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

__all__ = ["Corpus", "stdlib_files", "tokenizer", "encode", "Windows", "loader", "train_batches", "prepare",
           "unigram_entropy"]

SPECIAL = "<|endoftext|>"  # separates files in the token stream (and is the tokenizer's first id, 0)


def stdlib_files(max_train_bytes: int = 4_000_000, max_val_bytes: int = 200_000, val_every: int = 10,
                 root: str | None = None) -> tuple[list[str], list[str]]:
    """(train files, validation files): sorted ``*.py`` under ``root`` (default: the standard library), every
    ``val_every``-th file held out, each list a prefix of its split of at most ``max_*_bytes`` (at least one file)."""
    root = root or sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(root, "*.py")))
    if len(files) < 2:
        raise FileNotFoundError(f"examples/data.py: fewer than 2 *.py files in {root}: no corpus to split")
    val_every = min(val_every, len(files))
    train = [f for i, f in enumerate(files) if i % val_every != val_every // 2]
    val = [f for i, f in enumerate(files) if i % val_every == val_every // 2]
    return _cap(train, max_train_bytes), _cap(val, max_val_bytes)


def _cap(files: list[str], max_bytes: int) -> list[str]:
    out, total = [], 0
    for f in files:
        total += os.path.getsize(f)
        if out and total > max_bytes:
            break
        out.append(f)
    return out


def _read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as fh:
        return fh.read()


def _digest(files: Sequence[str], *extra) -> str:
    h = hashlib.sha256(json.dumps([[os.path.basename(f), os.path.getsize(f)] for f in files] + list(extra)).encode())
    return h.hexdigest()[:12]


def tokenizer(train_files: Sequence[str], vocab: int, cache_dir: str):
    """A byte-level BPE of ``vocab`` tokens trained on ``train_files`` (cached: trained once per corpus and size)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = os.path.join(cache_dir, f"bpe-{vocab}-{_digest(train_files)}.json")
    if os.path.exists(path):
        return Tokenizer.from_file(path)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[SPECIAL], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((_read(f) for f in train_files), trainer=trainer)
    os.makedirs(cache_dir, exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"  # one per process: two runs sharing the cache may both train it
    tok.save(tmp)
    os.replace(tmp, path)  # complete or absent: a rank never reads half a file
    return tok


def encode(files: Sequence[str], tok, cache_dir: str) -> torch.Tensor:
    """``files`` as one int32 tensor of token ids, each file followed by the end-of-text token (cached)."""
    tok_key = hashlib.sha256(tok.to_str().encode()).hexdigest()[:12]  # a retrained tokenizer: new ids
    path = os.path.join(cache_dir, f"tokens-{tok.get_vocab_size()}-{_digest(files, tok_key)}.pt")
    if os.path.exists(path):
        return torch.load(path)
    eot = tok.token_to_id(SPECIAL)
    ids: list[int] = []
    for enc in tok.encode_batch([_read(f) for f in files]):
        ids += enc.ids + [eot]
    out = torch.tensor(ids, dtype=torch.int32)
    os.makedirs(cache_dir, exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    torch.save(out, tmp)
    os.replace(tmp, path)
    return out


class Windows(Dataset):
    """Non-overlapping windows of a token stream: item ``i`` is ``(x, y)``, long tensors [seq], ``y`` = ``x``
    shifted by one token (the window is ``seq + 1`` tokens; consecutive windows share one token)."""

    def __init__(self, tokens: torch.Tensor, seq: int):
        if tokens.numel() < seq + 1:
            raise ValueError(f"{tokens.numel()} tokens make no window of seq {seq} + 1")
        self.tokens, self.seq = tokens, seq

    def __len__(self) -> int:
        return (self.tokens.numel() - 1) // self.seq

    def __getitem__(self, i: int):
        w = self.tokens[i * self.seq: (i + 1) * self.seq + 1].long()
        return w[:-1], w[1:]


def loader(data: Dataset, batch_size: int, rank: int, world: int, *, shuffle: bool, seed: int = 0) -> DataLoader:
    """A ``DataLoader`` whose ``DistributedSampler`` gives this rank its own ``1/world`` of ``data`` (equal counts:
    ``drop_last``, so every rank takes the same number of steps). Shuffled per epoch with ``seed`` when asked."""
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed, drop_last=True)
    return DataLoader(data, batch_size=batch_size, sampler=sampler, drop_last=shuffle)


def train_batches(dl: DataLoader, start: int = 0) -> Iterator:
    """The loader's batches epoch after epoch (``set_epoch`` each one), from global batch ``start`` on: a resumed
    run reads exactly the batches an uninterrupted one reads from there (the skipped ones are indexed, not read)."""
    per_epoch = len(dl)
    if per_epoch == 0:
        raise ValueError("the training split makes no batch: lower --batch-size or --seq, or use more files")
    epoch, skip = divmod(start, per_epoch)
    for e in itertools.count(epoch):
        dl.sampler.set_epoch(e)
        if skip:  # index the sampler instead of loading the batches it would skip
            idx = list(dl.sampler)[skip * dl.batch_size:]
            sub = DataLoader(dl.dataset, batch_size=dl.batch_size, sampler=idx, drop_last=True)
            skip = 0
            yield from sub
        else:
            yield from dl


def unigram_entropy(tokens: torch.Tensor, vocab: int) -> float:
    """Entropy in nats/token of ``tokens``' own unigram distribution: ``-sum_v p(v) ln p(v)``, ``p`` the counts'
    shares. A model predicting every token with these frequencies scores exactly this cross-entropy on them."""
    counts = torch.bincount(tokens.long().flatten(), minlength=vocab).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


class Corpus:
    """Both splits of the stdlib corpus, tokenized: ``tok``, ``train``/``val`` (int32 token streams), ``vocab``,
    the files of each split, and ``describe()`` for the log."""

    def __init__(self, tok, train_files, val_files, train, val):
        self.tok, self.train_files, self.val_files, self.train, self.val = tok, train_files, val_files, train, val
        self.vocab = tok.get_vocab_size()

    def describe(self) -> str:
        mb = lambda fs: sum(os.path.getsize(f) for f in fs) / 1e6  # noqa: E731
        return (f"data: Python {sysconfig.get_python_version()} standard library sources "
                f"({os.path.dirname(self.train_files[0])}), byte-level BPE vocab {self.vocab}; "
                f"train {len(self.train_files)} files {mb(self.train_files):.1f} MB {self.train.numel():,} tokens, "
                f"validation {len(self.val_files)} other files {mb(self.val_files):.2f} MB {self.val.numel():,} tokens")


def prepare(cache_dir: str, vocab: int, rank: int = 0, barrier=None, root: str | None = None,
            max_train_bytes: int = 4_000_000, max_val_bytes: int = 200_000) -> Corpus:
    """The tokenized corpus. Rank 0 trains and encodes into ``cache_dir`` first; the others then read the cache
    after ``barrier()`` (pass ``torch.distributed.barrier`` when a process group exists)."""
    train_files, val_files = stdlib_files(max_train_bytes, max_val_bytes, root=root)
    if rank == 0:
        tok = tokenizer(train_files, vocab, cache_dir)
        splits = encode(train_files, tok, cache_dir), encode(val_files, tok, cache_dir)
    if barrier is not None:
        barrier()
    if rank != 0:
        tok = tokenizer(train_files, vocab, cache_dir)
        splits = encode(train_files, tok, cache_dir), encode(val_files, tok, cache_dir)
    return Corpus(tok, train_files, val_files, *splits)


def _entropy_check() -> None:  # python examples/data.py: the corpus and its baseline, for a look
    c = prepare(os.path.expanduser("~/.cache/fshard-examples"), 4096)
    print(c.describe())
    print(f"unigram entropy of the validation split: {unigram_entropy(c.val, c.vocab):.4f} nats/token "
          f"(uniform over the vocabulary: {math.log(c.vocab):.4f})")


if __name__ == "__main__":
    _entropy_check()
