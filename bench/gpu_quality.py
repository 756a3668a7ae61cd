"""The report's regime on one GPU: ``python bench/gpu_quality.py [--smoke]`` (issue 27).

Prepared for a device lease, under 8 minutes of an H100; ``--smoke`` runs the same four phases
end to end on a CPU in about a minute with a tiny model, so the device run is not the first:

1. **copies and codecs on CUDA tensors**: GPT-2 124M (the real shape, random init) on ``cuda:0``
   in bf16; the SDK's own export (``ModelView.export``: device -> host float32) and load (host
   -> device), the same through pinned host buffers (``non_blocking`` copies, one synchronise),
   and each codec's encode and decode of the exported arrays (numpy, on the host, as a peer
   does). First, so that the CUDA paths are measured even if a later phase runs out of time;
2. **the warm start**: ``bench/pretrain.py --model-config gpt2 --device cuda`` (bf16 autocast)
   on IMDB reviews the fine-tune never trains, validates or tests on; no pretrained weights can
   be downloaded, so this stands in for ``gpt2``;
3. **serial**: the reference job ``train/finetune_gpt2.py --no-hub`` from that warm start at
   its own defaults' regime (global batch 256 blocks of 20 tokens, Adam 5e-4 constant), on the GPU;
4. **2 peers sharing the GPU**: the same command with ``--local-peers 2 --sync-every K``, with
   the defaults (whatever the job derives from the number of peers), each peer on ``cuda:0``.

It prints validation perplexity per round (serial vs the peers' mean, and their ratio) and
the timings, and writes ``results.json`` and ``summary.md`` to ``--out``. Every phase's wall
seconds are in the output, so a run that ran out of time says where.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import platform
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "train" / "finetune_gpt2.py"
DATA = REPO.parent / "shared" / "data"

#: The device run: ~8 minutes of an H100 in all (pretraining ~2, each fine-tune ~1-2).
FULL: dict[str, Any] = {
    "model_config": "gpt2",
    "pretrain": {"reviews": 12000, "steps": 800, "batch-size": 128, "lr": 1e-3},
    "finetune": {
        "train-samples": 2000,
        "val-samples": 200,
        "test-samples": 500,
        "epochs": 2,
        "batch-size": 256,
        "lr": 5e-4,
        "seed": 1,
    },
    "sync_every": 40,  # ~6 rounds of ~230 steps: the report's middle interval (~15% of training)
    "codecs": ["fp32", "bf16", "int8", "int4"],
    "repeat": 3,
}
#: --smoke: the same phases on a CPU in about a minute.
SMOKE: dict[str, Any] = {
    "model_config": "tiny",
    "pretrain": {"reviews": 300, "steps": 20, "batch-size": 16, "lr": 3e-3},
    "finetune": {
        "train-samples": 40,
        "val-samples": 8,
        "test-samples": 8,
        "max-steps": 8,
        "batch-size": 16,
        "lr": 5e-4,
        "seed": 1,
    },
    "sync_every": 4,
    "codecs": ["fp32", "int8"],
    "repeat": 1,
}


def load(name: str) -> ModuleType:
    """A module of this checkout by path (bench/pretrain.py, the reference job)."""
    path = {"pretrain": REPO / "bench" / "pretrain.py", "finetune_gpt2": TRAIN}[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def copies_and_codecs(settings: dict[str, Any], device: str) -> dict[str, Any]:
    """Phase 1: the SDK's device <-> host copies of a bf16 model, pinned copies, codec times."""
    import numpy as np
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from syncclient.weights import ModelView
    from syncwire import get_codec

    shape = load("finetune_gpt2").MODEL_CONFIGS[settings["model_config"]]
    model = GPT2LMHeadModel(GPT2Config(vocab_size=50257, **shape)).to(device, torch.bfloat16)
    view = ModelView(model)
    n = sum(t.numel() for t in view.tensors.values())
    cuda = device.startswith("cuda")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def best(fn: Any) -> float:
        times = []
        for _ in range(settings["repeat"] + 1):  # the first one warms up (allocations, pinning)
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        return min(times[1:])

    arrays = view.export()
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu",
        "values": n,
        "dtype": "bfloat16",
        "export_s": best(view.export),  # device bf16 -> host float32 numpy, as SyncClient.sync does
        "load_s": best(lambda: view.load(arrays)),  # host float32 -> device bf16
    }
    if cuda:  # the same bytes through page-locked buffers: what pinned host copies would buy
        pinned = {k: torch.empty(t.shape, dtype=torch.bfloat16, pin_memory=True) for k, t in view.tensors.items()}

        def d2h() -> None:
            for k, t in view.tensors.items():
                pinned[k].copy_(t.detach(), non_blocking=True)

        def h2d() -> None:
            for k, t in view.tensors.items():
                t.data.copy_(pinned[k], non_blocking=True)

        out["pinned_d2h_bf16_s"] = best(d2h)
        out["pinned_h2d_bf16_s"] = best(h2d)
        out["pinned_d2h_gbps"] = 2 * n / out["pinned_d2h_bf16_s"] / 1e9
    codecs = {}
    for spec in settings["codecs"]:
        codec = get_codec(spec)
        encoded: dict[str, dict[str, np.ndarray]] = {}

        def encode(codec: Any = codec, encoded: dict[str, Any] = encoded) -> None:
            for name, x in arrays.items():
                encoded[name] = codec.encode(x)

        def decode(codec: Any = codec, encoded: dict[str, Any] = encoded) -> None:
            for name, x in arrays.items():
                codec.decode(encoded[name], x.shape)

        enc = best(encode)
        codecs[spec] = {
            "encode_s": enc,
            "decode_s": best(decode),
            "wire_mb": sum(p.nbytes for parts in encoded.values() for p in parts.values()) / 1e6,
        }
    out["codecs"] = codecs
    return out


def finetune_argv(settings: dict[str, Any], warm: Path, out: Path) -> list[str]:
    argv = [sys.executable, str(TRAIN), "--output-dir", str(out), "--model", str(warm)]
    argv += ["--dataset", str(DATA / "imdb"), "--tokenizer", str(DATA / "gpt2-tokenizer")]
    for flag, value in settings["finetune"].items():
        argv += [f"--{flag}", str(value)]
    return [*argv, "--eval-every", str(settings["sync_every"])]


def run(argv: list[str], log: Path) -> float:
    """Run a phase's command, its output to ``log``; its wall seconds (SystemExit if it failed)."""
    print("$ " + " ".join(argv[1:]), flush=True)
    t0 = time.perf_counter()
    with log.open("wb") as f:
        code = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, cwd=REPO).returncode
    if code != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-5:]
        raise SystemExit(f"error: exit {code} ({log}):\n" + "\n".join(tail))
    return time.perf_counter() - t0


def curve(results: dict[str, Any]) -> dict[int, float]:
    """Validation perplexity per evaluated step (the last evaluation of a step wins)."""
    return {e["step"]: e["val_ppl"] for e in results["evals"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny model, a few steps: the whole script on a CPU")
    p.add_argument("--out", type=Path, help="output folder (default: bench/results/gpu-quality-<date>[-smoke])")
    p.add_argument("--device", help="default: cuda:0 if there is one, else cpu")
    args = p.parse_args(argv)
    settings = SMOKE if args.smoke else FULL
    import torch

    device = args.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {device}: torch sees no CUDA device")
    if not args.smoke and not device.startswith("cuda"):
        p.error("the full run wants a GPU (a CPU would take hours): use --smoke here")
    out = (
        args.out or REPO / "bench" / "results" / f"gpu-quality-{datetime.date.today()}{'-smoke' if args.smoke else ''}"
    )
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    results |= {"command": " ".join(["python", "bench/gpu_quality.py", *(argv or sys.argv[1:])])}
    results |= {"settings": settings, "device": device, "phases_s": {}}
    t_all = time.perf_counter()

    def save() -> None:
        (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")

    print(f"1/4 copies and codecs on {device} ...", flush=True)
    t0 = time.perf_counter()
    results["copies"] = copies_and_codecs(settings, device)
    results["phases_s"]["copies"] = time.perf_counter() - t0
    if device.startswith("cuda"):
        torch.cuda.empty_cache()  # phase 1's model is gone: its memory back for the fine-tunes
    save()

    print("2/4 warm start (bench/pretrain.py) ...", flush=True)
    t0 = time.perf_counter()
    pretrain = load("pretrain")
    ft = settings["finetune"]
    pre_argv = ["--model-config", settings["model_config"], "--device", device.split(":")[0], "--threads", "2"]
    pre_argv += [f"--{k}={v}" for k, v in settings["pretrain"].items()]
    pre_argv += ["--exclude-seeds", str(ft["seed"]), "--exclude-train", str(ft["train-samples"])]
    pre_argv += ["--exclude-val", str(ft["val-samples"]), "--exclude-test", str(ft["test-samples"])]
    warm = out / "pretrained"  # kept: a second call (after a time-out, say) starts at phase 3
    pretrain.pretrain(pretrain.parse([*pre_argv, "--out", str(warm)]))
    results["pretrain"] = json.loads((warm / "meta.json").read_text())
    results["phases_s"]["pretrain"] = time.perf_counter() - t0
    save()

    print("3/4 serial fine-tune ...", flush=True)
    serial_argv = [*finetune_argv(settings, warm, out / "serial"), "--no-hub"]
    results["phases_s"]["serial"] = run(serial_argv, out / "serial.log")
    serial = json.loads((out / "serial" / "results.json").read_text())
    save()

    print("4/4 2 peers sharing the device ...", flush=True)
    peers_argv = finetune_argv(settings, warm, out / "peers")
    peers_argv += ["--local-peers", "2", "--sync-every", str(settings["sync_every"]), "--run", "gpu-quality"]
    results["phases_s"]["peers"] = run(peers_argv, out / "peers.log")
    top = json.loads((out / "peers" / "results.json").read_text())
    peers = [json.loads((out / "peers" / p / "results.json").read_text()) for p in sorted(top["final"])]
    results["phases_s"]["total"] = time.perf_counter() - t_all

    s_curve = curve(serial)
    p_curves = [curve(r) for r in peers]
    steps = sorted(set(s_curve).intersection(*p_curves))
    rows = [{"step": s, "serial": s_curve[s], "peers": sum(c[s] for c in p_curves) / len(p_curves)} for s in steps]
    results["per_round"] = rows
    results["final"] = {
        "serial_val_ppl": serial["final_val_ppl"],
        "peers_val_ppl": sum(r["final_val_ppl"] for r in peers) / len(peers),
        "serial_test_ppl": serial["final_test_ppl"],
        "peers_test_ppl": sum(r["final_test_ppl"] for r in peers) / len(peers),
        "weights_identical": top["weights_identical"],
        "weights_equal_hub": top["weights_equal_hub"],
        "peer_config": {k: peers[0]["config"].get(k) for k in ("world_size", "per_peer_batch", "lr", "lr_scaling")},
        "device_of_peers": peers[0]["config"].get("device"),
    }
    save()
    summary = render(results)
    (out / "summary.md").write_text(summary + "\n")
    print(summary)
    ok = top["weights_identical"] and top["weights_equal_hub"]
    return 0 if ok else 1


def render(results: dict[str, Any]) -> str:
    c, f = results["copies"], results["final"]
    ratio = f["peers_val_ppl"] / f["serial_val_ppl"]
    lines = [
        f"{results['date']} · `{results['command']}` · {c['device']} ({results['device']})",
        "",
        f"Final validation perplexity: serial {f['serial_val_ppl']:.2f}, 2 peers {f['peers_val_ppl']:.2f} "
        f"({(ratio - 1) * 100:+.2f}%); test {f['serial_test_ppl']:.2f} / {f['peers_test_ppl']:.2f}; peers' final "
        f"weights identical: {f['weights_identical']}, equal to the hub's: {f['weights_equal_hub']}; "
        f"peers ran on {f['device_of_peers']} with {f['peer_config']}.",
        "",
        "| step | serial val ppl | 2 peers val ppl | vs serial |",
        "|---:|---:|---:|---:|",
    ]
    for r in results["per_round"]:
        lines.append(
            f"| {r['step']} | {r['serial']:.2f} | {r['peers']:.2f} | {(r['peers'] / r['serial'] - 1) * 100:+.2f}% |"
        )
    lines += [
        "",
        f"Copies of {c['values'] / 1e6:.1f}M {c['dtype']} values: export (device -> host float32, the SDK) "
        f"{c['export_s'] * 1e3:.1f} ms, load (host -> device) {c['load_s'] * 1e3:.1f} ms"
        + (
            f"; pinned bf16 d2h {c['pinned_d2h_bf16_s'] * 1e3:.1f} ms ({c['pinned_d2h_gbps']:.1f} GB/s), "
            f"h2d {c['pinned_h2d_bf16_s'] * 1e3:.1f} ms"
            if "pinned_d2h_bf16_s" in c
            else "; pinned copies: no CUDA device"
        )
        + ".",
        "",
        "| codec | encode ms | decode ms | wire MB |",
        "|---|---:|---:|---:|",
    ]
    for spec, t in c["codecs"].items():
        lines.append(f"| {spec} | {t['encode_s'] * 1e3:.1f} | {t['decode_s'] * 1e3:.1f} | {t['wire_mb']:.1f} |")
    phases = ", ".join(f"{k} {v:.0f} s" for k, v in results["phases_s"].items())
    lines += ["", f"Wall seconds: {phases}."]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
