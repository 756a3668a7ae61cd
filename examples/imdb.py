"""IMDB reviews from the offline data beside the checkout (``../shared/data/imdb``), for the examples.

``sample.parquet`` holds 2,000 train and 500 test reviews (labels 0 = negative, 1 = positive).
The two small classifiers read a hashed bag of words (:func:`bag_of_words`): no tokenizer,
seconds of training on a CPU, about 75% test accuracy.
"""

from __future__ import annotations

import re
import zlib
from pathlib import Path

import pyarrow.parquet as pq
import torch

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def reviews(split: str, data: Path = DATA) -> tuple[list[str], list[int]]:
    """The sample's ``split`` ("train" or "test"): texts and labels, in file order."""
    table = pq.read_table(data / "imdb" / "sample.parquet", columns=["text", "label", "split"]).to_pydict()
    rows = [(t, y) for t, y, s in zip(table["text"], table["label"], table["split"], strict=True) if s == split]
    return [t for t, _ in rows], [y for _, y in rows]


def bag_of_words(texts: list[str], dim: int = 1024) -> torch.Tensor:
    """log(1 + count) of each text's lowercase words, hashed into ``dim`` buckets (crc32: the
    same buckets in every process, unlike ``hash``)."""
    out = torch.zeros(len(texts), dim)
    for i, text in enumerate(texts):
        for word in re.findall(r"[a-z']+", text.lower()):
            out[i, zlib.crc32(word.encode()) % dim] += 1
    return torch.log1p(out)
