"""Issue 39, coalesced reads: the requests a reducer's lease makes to read one update object.

    python bench/lease_reads.py                        # GPT-2 124M, int8 and fp32, K = 1 2
    python bench/lease_reads.py --codecs int8 --reducers 1 2 4 --threads 2

For each codec and K, the leases the hub would cut (``plan`` with S3's part floor, as a bucket's
round has them) each read their slices' wire parts of an update through the reducers' own reader
(:func:`syncserver.reduce.lease.object_reader` as a lease opens an update: each run one streamed GET;
``--windowed``: the 8 MiB windows it used before, which version v and the momentum still use),
from a store stand-in that counts each ``read`` and ``stream`` (one ranged GET each) and ``head``
and the bytes they move. Beside them: the contiguous byte runs the lease needs (its slices' parts
merged), the floor: one GET per run. ``--threads`` reads the slices from that many threads, as a
lease's fold pool does (the count then varies from run to run: windows race). No network, no
store: seconds on any machine.
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH.parent), str(BENCH)]

import round as rb  # noqa: E402 (model shapes)

from syncserver.reduce.lease import object_reader  # noqa: E402
from syncserver.reduce.plan import PART_MIN, multi_part, pieces, plan  # noqa: E402
from syncwire import get_codec  # noqa: E402
from syncwire.codecs import DTYPES, wire_name  # noqa: E402
from syncwire.format import encode_header  # noqa: E402

parser = argparse.ArgumentParser(description="GETs per update object per lease.")
parser.add_argument("--model", choices=sorted(rb.MODELS), default="gpt2")
parser.add_argument("--codecs", nargs="+", default=["int8", "fp32"])
parser.add_argument("--reducers", type=int, nargs="+", default=[1, 2], help="K values")
parser.add_argument("--threads", type=int, default=1, help="threads reading a lease's slices")
parser.add_argument("--windowed", action="store_true", help="8 MiB windows instead of one streamed GET per run")


class CountingStore:
    """An object of ``size`` bytes whose first are ``head`` (the rest zeros), counting requests."""

    url = "count://"

    def __init__(self, size: int, head: bytes) -> None:
        self.size, self.head_bytes = size, head
        self.heads = self.gets = self.moved = 0

    def head(self, name: str) -> Any:
        self.heads += 1
        return argparse.Namespace(size=self.size)

    def read(self, name: str, start: int = 0, end: int | None = None) -> bytearray:
        end = self.size if end is None else min(end, self.size)
        self.gets += 1
        self.moved += end - start
        out = bytearray(end - start)
        piece = self.head_bytes[start:end]
        out[: len(piece)] = piece
        return out

    def stream(self, name: str, start: int = 0, end: int | None = None) -> Any:
        data = self.read(name, start, end)
        for at in range(0, len(data), 1 << 20):
            yield bytes(data[at : at + (1 << 20)])


def runs(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``spans`` merged where they touch or overlap."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def main() -> None:
    args = parser.parse_args()
    schema = rb.model_schema(args.model)
    print("| codec | K | lease | slices | part reads | HEAD + GETs | read (MB) | runs needed | run bytes (MB) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for spec in args.codecs:
        codec = get_codec(spec)
        entries = [
            (wire_name(n, s), dt, sh) for n, shape in schema.items() for s, (dt, sh) in codec.layout(shape).items()
        ]
        head, infos = encode_header(entries, {"codec": spec})
        where = {i.name: (len(head) + i.start, DTYPES[i.dtype].itemsize) for i in infos}
        size = len(head) + infos[-1].end
        items = pieces(codec, codec, schema)
        for k in args.reducers:
            for j, span in enumerate(plan(items, k, whole_tensors=multi_part(codec), min_writes=PART_MIN)):
                slices = items[span.first : span.stop]
                reads = [(wire_name(p.name, s), f, f + c) for p in slices for s, (f, c) in p.parts.items()]
                store = CountingStore(size, head)
                wire = object_reader(store, "update", reads, stream=not args.windowed)  # type: ignore[arg-type]

                def one(p: Any, wire: Any = wire) -> None:
                    for s, (f, c) in p.parts.items():
                        wire.read(wire_name(p.name, s), f, f + c)

                with ThreadPoolExecutor(args.threads) as pool:
                    list(pool.map(one, slices))
                wire.close()
                need = runs([(where[n][0] + a * where[n][1], where[n][0] + b * where[n][1]) for n, a, b in reads])
                print(
                    f"| {spec} | {k} | {j} | {len(slices)} | {len(reads)} | {store.heads} + {store.gets} "
                    f"| {store.moved / 1e6:.1f} | {len(need)} | {sum(hi - lo for lo, hi in need) / 1e6:.1f} |"
                )


if __name__ == "__main__":
    main()
