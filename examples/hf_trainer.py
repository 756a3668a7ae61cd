"""A Hugging Face ``Trainer`` fine-tune: a small GPT-2 on IMDB reviews, as a language model.

    python examples/hf_trainer.py                                   # alone
    weightsync-run --local-peers 2 -- python examples/hf_trainer.py   # 2 peers, same script

Nothing here knows about weightsync. Under ``weightsync-run`` the ``Trainer`` gets weightsync's
``SyncCallback`` when it is built and its ``train_dataset`` becomes this peer's share; the
callback syncs every ``--sync-every`` optimizer steps and once more at the end of training, so
what the script saves afterwards is the same model on every peer. The GPT-2 is randomly
initialised (a tiny one: 2 layers, 32 wide; the tokenizer and reviews come from the offline data
beside the checkout), so "fine-tune" is a figure of speech here: swap in
``AutoModelForCausalLM.from_pretrained("gpt2")`` where the Hugging Face Hub is reachable.
Writes ``out/model/`` (``save_pretrained``) and ``out/metrics.json``, relative: in the peer's
own folder.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never wait on the network

import torch
from datasets import Dataset
from imdb import DATA, reviews
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, default_data_collator

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--data", type=Path, default=DATA, help="the offline data folder (imdb/, gpt2-tokenizer/)")
parser.add_argument("--reviews", type=int, default=40, help="training reviews")
parser.add_argument("--block-size", type=int, default=32, help="tokens per training sample")
parser.add_argument("--epochs", type=float, default=1)
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--out", type=Path, default=Path("out"))
args = parser.parse_args()

torch.manual_seed(0)
tokenizer = AutoTokenizer.from_pretrained(args.data / "gpt2-tokenizer")


def blocks(texts: list[str]) -> Dataset:
    """The texts' tokens, concatenated and cut into blocks (the causal-LM recipe)."""
    ids = [t for text in texts for t in tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]]
    n = len(ids) // args.block_size * args.block_size
    chunks = [ids[i : i + args.block_size] for i in range(0, n, args.block_size)]
    return Dataset.from_dict({"input_ids": chunks, "labels": chunks})


texts, _ = reviews("train", args.data)
train, held_out = blocks(texts[: args.reviews]), blocks(texts[-4:])
config = GPT2Config(vocab_size=len(tokenizer), n_positions=args.block_size, n_layer=2, n_embd=32, n_head=2)
model = GPT2LMHeadModel(config)

trainer = Trainer(
    model=model,
    args=TrainingArguments(
        output_dir=str(args.out / "trainer"),
        per_device_train_batch_size=args.batch_size,
        num_train_epochs=args.epochs,
        learning_rate=2e-3,
        logging_steps=5,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    ),
    train_dataset=train,
    eval_dataset=held_out,
    data_collator=default_data_collator,
)
trainer.train()
metrics = trainer.evaluate()
print(f"held-out loss {metrics['eval_loss']:.4f} after {trainer.state.global_step} steps")
trainer.save_model(str(args.out / "model"))
(args.out / "metrics.json").write_text(json.dumps(metrics) + "\n")
