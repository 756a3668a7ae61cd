"""Codecs: how a float32 tensor becomes wire tensors and back. numpy only, pure functions.

Peers encode their deltas with it, the hub decodes them and encodes the merged update, and every
peer decodes that: hub and peers apply the *same decoded values*, so all hold bit-identical
weights after a sync, whatever the codec loses. A codec works on one tensor at a time (nobody
holds two copies of a model), turning tensor ``name`` into wire tensors: the main one keeps the
name, extra parts (a quantizer's scales) are ``name:part``. For lossy codecs the client keeps the
residual ``x - decode(encode(x))`` for its next delta (error feedback, docs/concepts/codecs.md).
Codecs are named by a spec string, ``"fp32"`` or with parameters (``"int8:block=128"``).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping

import numpy as np

from syncwire.format import DTYPES, FormatError, TensorInfo

__all__ = ["Codec", "Schema", "available_codecs", "check_layout", "decode_tensor", "encode_model"]
__all__ += ["get_codec", "layout_bytes", "register_codec", "slices", "wire_layout"]

#: The model as the wire sees it: tensor name -> shape, in a fixed order. Every synced
#: tensor is float32 on the wire's reference side.
Schema = dict[str, tuple[int, ...]]

#: Wire tensor name -> (safetensors dtype, shape).
Layout = dict[str, tuple[str, tuple[int, ...]]]


class Codec(ABC):
    """Encode one float32 tensor into named wire parts; decode them back to float32."""

    #: The spec string that builds this codec (``get_codec(codec.spec)`` is an equal codec).
    spec: str
    #: True when ``decode(encode(x)) == x`` exactly; lossy codecs get error feedback.
    lossless: bool
    #: True when the hub keeps error feedback for the results it encodes, as peers do for their
    #: updates (a residual file per version): for codecs that drop most of each merged update
    #: (``topk``); the quantizers' rounding is small enough to go without the 4 bytes per value.
    hub_feedback: bool = False
    #: True when :meth:`decode` can refuse parts of the right layout with finite floats (``topk``:
    #: bad offsets): the hub decodes such an update before acknowledging it, so a bad one is a 422.
    check_on_receipt: bool = False
    #: True when a peer's last sync is followed by one more round that sends its residual. Not for
    #: ``topk``: what error feedback held back for rounds is partly learned again meanwhile, and
    #: sending it overshoots (3 seeds: +0.74% over fp32 sync without a flush, +1.06% with one in
    #: topk, +1.69% with the residual sent whole; bench/RESULTS.md).
    flush: bool = True

    @abstractmethod
    def layout(self, shape: tuple[int, ...]) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Part suffix (``""`` for the main part) -> (dtype, shape) for a tensor of ``shape``."""

    @abstractmethod
    def encode(self, x: np.ndarray) -> dict[str, np.ndarray]:
        """Encode a float32 array into its parts, keyed like :meth:`layout`."""

    @abstractmethod
    def decode(self, parts: Mapping[str, np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
        """Decode the parts of one tensor into a new float32 array of ``shape``."""

    def __repr__(self) -> str:
        return f"<codec {self.spec}>"

    def __eq__(self, other: object) -> bool:  # a spec is the one spelling of a codec's parameters
        return type(other) is type(self) and isinstance(other, Codec) and other.spec == self.spec

    def __hash__(self) -> int:
        return hash((type(self), self.spec))


class Fp32(Codec):
    """Lossless float32: 4 bytes per value."""

    spec = "fp32"
    lossless = True

    def layout(self, shape: tuple[int, ...]) -> dict[str, tuple[str, tuple[int, ...]]]:
        return {"": ("F32", shape)}

    def encode(self, x: np.ndarray) -> dict[str, np.ndarray]:
        return {"": np.asarray(x, dtype=np.float32, order="C")}

    def decode(self, parts: Mapping[str, np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
        return np.array(parts[""], dtype=np.float32).reshape(shape)


class Bf16(Codec):
    """bfloat16 with round-to-nearest-even: 2 bytes per value, 8 bits of mantissa.

    The bits travel as safetensors ``BF16``, so ``safetensors.torch`` reads them natively.
    """

    spec = "bf16"
    lossless = False

    def layout(self, shape: tuple[int, ...]) -> dict[str, tuple[str, tuple[int, ...]]]:
        return {"": ("BF16", shape)}

    def encode(self, x: np.ndarray) -> dict[str, np.ndarray]:
        bits = np.asarray(x, dtype=np.float32, order="C").view(np.uint32)
        rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
        return {"": rounded.astype(np.uint16)}

    def decode(self, parts: Mapping[str, np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
        bits = np.asarray(parts[""], dtype=np.uint16).astype(np.uint32) << np.uint32(16)
        return bits.view(np.float32).reshape(shape)


_REGISTRY: dict[str, type[Codec]] = {}


def register_codec(name: str, cls: type[Codec]) -> None:
    """Make ``cls`` available under ``name`` in spec strings (``name`` or ``name:k=v,...``)."""
    _REGISTRY[name] = cls


register_codec("fp32", Fp32)
register_codec("bf16", Bf16)


def available_codecs() -> list[str]:
    """The codec names that :func:`get_codec` accepts."""
    return sorted(_REGISTRY)


def get_codec(spec: str) -> Codec:
    """Build the codec a spec string names, e.g. ``"int8:block=64"``; ``ValueError`` with the
    known codecs for an unknown name or a bad parameter."""
    name, _, params = spec.partition(":")
    if name not in _REGISTRY:
        raise ValueError(f"unknown codec {spec!r}; available: {', '.join(available_codecs())}")
    kwargs: dict[str, int] = {}
    for item in filter(None, params.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not value.isdigit():
            raise ValueError(f"codec {spec!r}: parameters are key=integer, got {item!r}")
        kwargs[key] = int(value)
    try:
        return _REGISTRY[name](**kwargs)
    except TypeError:
        raise ValueError(f"codec {name!r} takes no parameter among {sorted(kwargs)}") from None


def wire_name(name: str, suffix: str) -> str:
    """The name part ``suffix`` of tensor ``name`` travels under: ``name`` for the main part (suffix
    ``""``), ``name:suffix`` for the others. The one place this rule is written."""
    return f"{name}:{suffix}" if suffix else name


def wire_layout(codec: Codec, schema: Schema) -> Layout:
    """Every wire tensor a body encoded with ``codec`` must hold, with dtype and shape."""
    return {
        wire_name(name, suffix): spec for name, shape in schema.items() for suffix, spec in codec.layout(shape).items()
    }


def layout_bytes(layout: Layout) -> int:
    """Size of the data section a body with ``layout`` has."""
    return sum(math.prod(shape) * DTYPES[dtype].itemsize for dtype, shape in layout.values())


def check_layout(infos: Mapping[str, TensorInfo], expected: Layout) -> None:
    """Raise :class:`FormatError` unless the parsed header holds exactly ``expected``."""
    wrong = {"missing": expected.keys() - infos.keys(), "unexpected": infos.keys() - expected.keys()}
    if any(wrong.values()):
        parts = [f"{what} {sorted(names)[:5]}" for what, names in wrong.items() if names]
        raise FormatError("tensors do not match the run's schema: " + "; ".join(parts))
    for name, (dtype, shape) in expected.items():
        info = infos[name]
        if info.dtype != dtype or info.shape != tuple(shape):
            raise FormatError(
                f"tensor {name!r} is {info.dtype}{list(info.shape)}, the run expects {dtype}{list(shape)}"
            )


def encode_model(codec: Codec, arrays: Mapping[str, np.ndarray]) -> Iterator[tuple[str, str, np.ndarray, str]]:
    """Encode tensor by tensor: yield ``(name, wire name, wire array, dtype)``."""
    for name, x in arrays.items():
        layout = codec.layout(x.shape)
        for suffix, part in codec.encode(x).items():
            yield name, wire_name(name, suffix), part, layout[suffix][0]


def decode_tensor(codec: Codec, wire: Mapping[str, np.ndarray], name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Decode tensor ``name`` from a mapping of wire tensors (e.g. a memory-mapped file)."""
    parts = {suffix: wire[wire_name(name, suffix)] for suffix in codec.layout(shape)}
    return codec.decode(parts, shape)


#: Values per slice (see :func:`slices`): 4 MB of float32, small enough to stay in cache.
SLICE_VALUES = 1 << 20


def slices(codec: Codec, shape: tuple[int, ...]) -> list[tuple[int, int, dict[str, tuple[int, int]]]]:
    """Cut a tensor's values into slices that ``codec`` encodes and decodes on their own:
    ``(start, stop, {part suffix: (first, count)})`` for each slice of the flattened tensor, where
    its values lie in each flattened wire part. The hub and the peers then work a few MB at a time
    (GPT-2's embedding alone is 154 MB): temporaries stay small and warm in cache.

    Slices start on multiples of the codec's ``block`` (a quantizer's scale per block), and the
    parts' ranges come from the codec's layout of a slice, checked to tile every part exactly; a
    codec whose parts do not split so (one scale per tensor, say) gets one slice, always right.
    """

    def sizes(layout: dict[str, tuple[str, tuple[int, ...]]]) -> dict[str, int]:
        return {suffix: math.prod(part_shape) for suffix, (_, part_shape) in layout.items()}

    n = math.prod(shape)
    total = sizes(codec.layout(shape))
    whole = [(0, n, {suffix: (0, count) for suffix, count in total.items()})]
    block = getattr(codec, "block", 1)
    block = block if isinstance(block, int) and block > 0 else 1
    step = max(block, SLICE_VALUES // block * block)
    if n <= step:
        return whole
    out: list[tuple[int, int, dict[str, tuple[int, int]]]] = []
    first = dict.fromkeys(total, 0)
    for start in range(0, n, step):
        stop = min(n, start + step)
        counts = sizes(codec.layout((stop - start,)))
        if counts.keys() != total.keys():
            return whole
        out.append((start, stop, {suffix: (first[suffix], counts[suffix]) for suffix in counts}))
        first = {suffix: first[suffix] + counts[suffix] for suffix in counts}
    return out if first == total else whole


# Whoever reaches the codecs, by any import, finds every one registered (int8, int4, topk).
from syncwire import quant, sparse  # noqa: E402, F401
