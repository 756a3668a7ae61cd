"""Each peer trains on its own share of the data, and counts the samples it trained
(docs/launcher.md, "Sharding").

With a rank among several peers (``WEIGHTSYNC_RANK`` / ``WEIGHTSYNC_WORLD_SIZE``) and sharding on
(``--no-shard`` turns it off): a Hugging Face ``Trainer``'s ``train_dataset`` becomes its rank's
share (:func:`shard_dataset`; evaluation data stays whole), and every ``DataLoader`` over a
map-style dataset with the default sampler gets :class:`ShardSampler` around it (evaluation
loaders too: a DataLoader does not say what it is for). A share is every ``world``-th sample from
``rank`` on, of the first ``n // world * world``: disjoint, equal (peers take the same steps and
meet at every sync), independent of the seeds (a shuffled loader shuffles within its share). A
DataLoader with a sampler of its own, or over an ``IterableDataset``, stays whole, and says so.

Counting: each batch a ``DataLoader`` yields with autograd on (training, not a ``no_grad``
evaluation) adds its batch size to what a plain loop's next step reports (:func:`take_samples`).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterator, Sized
from typing import Any, cast

import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, Sampler, SequentialSampler, Subset
from torch.utils.data.dataloader import _BaseDataLoaderIter

from syncclient.hooks import session
from syncclient.hooks.settings import HookSettings

__all__ = ["ShardSampler", "install", "shard_dataset", "take_samples"]

OFF = "turn this off with --no-shard (WEIGHTSYNC_SHARD=0)"

_samples = 0  # trained since the last take_samples()


class ShardSampler(Sampler[int]):
    """The indices of ``inner`` that are ``rank`` modulo ``world`` and below ``size // world * world``."""

    def __init__(self, inner: Sampler[int], size: int, rank: int, world: int) -> None:
        self.inner, self.rank, self.world = inner, rank, world
        self.limit = size // world * world

    def __iter__(self) -> Iterator[int]:
        rank, world, limit = self.rank, self.world, self.limit
        return iter([i for i in self.inner if i < limit and i % world == rank])

    def __len__(self) -> int:
        return self.limit // self.world


def install(settings: HookSettings) -> None:
    """Patch ``DataLoader`` (sharding, when asked) and its iterators (counting); at torch's import."""
    if settings.shards:
        DataLoader.__init__ = _sharding_init(DataLoader.__init__, settings)  # type: ignore[method-assign]
    _BaseDataLoaderIter.__next__ = _counting_next(_BaseDataLoaderIter.__next__)  # type: ignore[method-assign]


def take_samples() -> int:
    """The samples of the training batches drawn since the last call (0: no DataLoader)."""
    global _samples
    samples, _samples = _samples, 0
    return samples


def shard_dataset(dataset: Any, settings: HookSettings, what: str) -> Any:
    """``dataset``'s share for this rank: ``datasets.Dataset.select`` (it keeps the columns the
    Trainer reads), else a ``torch.utils.data.Subset``. Unsized datasets stay whole."""
    if dataset is None or not settings.shards:
        return dataset
    assert settings.rank is not None and settings.world_size is not None
    if isinstance(dataset, IterableDataset) or not isinstance(dataset, Sized):
        session.note(f"{what} has no length, so it is not sharded: every peer trains on all of it")
        return dataset
    n, rank, world = len(dataset), settings.rank, settings.world_size
    indices = range(rank, n // world * world, world)
    session.note(_share(what, n, rank, world))
    return dataset.select(indices) if hasattr(dataset, "select") else Subset(cast(Any, dataset), indices)


def _share(what: str, n: int, rank: int, world: int) -> str:
    return (
        f"{what} of {n} samples: rank {rank} of {world} takes {n // world} of them (numbers {rank}, "
        f"{rank + world}, {rank + 2 * world}, ...; {n % world} left out); {OFF}"
    )


def _sharding_init(original: Any, settings: HookSettings) -> Any:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self: DataLoader[Any], *args: Any, **kwargs: Any) -> None:
        if session.uses_sdk() or session.owner() == "transformers":  # they shard their own way
            return original(self, *args, **kwargs)
        try:
            bound = signature.bind(self, *args, **kwargs)
        except TypeError:
            return original(self, *args, **kwargs)  # DataLoader's own error for the program's mistake
        sampler = _shard_sampler(bound.arguments, settings)
        if sampler is not None:
            bound.arguments.update(sampler=sampler, shuffle=None)
        return original(*bound.args, **bound.kwargs)

    return __init__


def _shard_sampler(arguments: dict[str, Any], settings: HookSettings) -> ShardSampler | None:
    assert settings.rank is not None and settings.world_size is not None
    dataset = arguments.get("dataset")
    what = f"a DataLoader over {type(dataset).__name__}"
    own = arguments.get("sampler") if arguments.get("sampler") is not None else arguments.get("batch_sampler")
    if own is not None:
        if not isinstance(own, ShardSampler):  # Lightning may rebuild a loader with our sampler
            session.note(f"{what} has its own {type(own).__name__}, so it is not sharded", once=True)
        return None
    if isinstance(dataset, IterableDataset) or not isinstance(dataset, Sized):
        session.note(f"{what} has no length, so it is not sharded: every peer reads all of it", once=True)
        return None
    shuffle = bool(arguments.get("shuffle"))
    inner = RandomSampler(dataset, generator=arguments.get("generator")) if shuffle else SequentialSampler(dataset)
    session.note(_share(what, len(dataset), settings.rank, settings.world_size), once=True)
    return ShardSampler(inner, len(dataset), settings.rank, settings.world_size)


def _counting_next(original: Any) -> Any:
    @functools.wraps(original)
    def __next__(self: _BaseDataLoaderIter) -> Any:
        global _samples
        batch = original(self)
        if torch.is_grad_enabled():
            _samples += getattr(self._index_sampler, "batch_size", None) or 1
        return batch

    return __next__
