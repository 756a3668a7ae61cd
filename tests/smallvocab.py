"""GPT-2's tokenizer cut to its first merges, for runs of the reference job that must be quick.

With the full 50,257 tokens the output layer and its softmax are ~98% of a tiny GPT-2's compute
(measured: 23 of 24 CPU-s of the reference job's 12 steps); with 1,025 the same run takes
a few. It is still GPT-2's byte-level BPE, class and special token (its merge of rank r is token
256 + r, so the first merges with their tokens are a complete tokenizer): reviews come out
~1.8x as many tokens. The standard library only: tests/conftest.py and bench/chaos.py use it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

SMALL_VOCAB_MERGES = 768  # GPT-2's first 768 BPE merges: a 1,025-token vocabulary


def small_vocab_data(shared: Path, folder: Path, merges: int = SMALL_VOCAB_MERGES) -> Path:
    """``folder`` made an offline data folder: ``imdb/`` (a link to ``shared``'s) and
    ``gpt2-tokenizer/``, ``shared``'s cut to its first ``merges`` merges."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "imdb").symlink_to(shared / "imdb")
    source, tokenizer = shared / "gpt2-tokenizer", folder / "gpt2-tokenizer"
    tokenizer.mkdir()
    size = 256 + merges
    vocab = {t: i for t, i in json.loads((source / "vocab.json").read_text()).items() if i < size}
    vocab["<|endoftext|>"] = size  # BOS, EOS and UNK, as in GPT-2
    (tokenizer / "vocab.json").write_text(json.dumps(vocab))
    header_and_merges = (source / "merges.txt").read_text().splitlines()[: 1 + merges]
    (tokenizer / "merges.txt").write_text("\n".join(header_and_merges) + "\n")
    shutil.copy(source / "tokenizer_config.json", tokenizer)
    return folder
