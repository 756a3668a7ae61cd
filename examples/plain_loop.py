"""A plain PyTorch training loop: a bag-of-words sentiment classifier on IMDB reviews.

    python examples/plain_loop.py                                   # alone
    weightsync-run --local-peers 2 -- python examples/plain_loop.py   # 2 peers, same script

Nothing here knows about weightsync. Under ``weightsync-run`` the optimizer's steps are seen,
the model that owns its parameters is synced every ``--sync-every`` steps, the DataLoader gives
each peer its half of the reviews, and the save at the end (it reads the model's state) syncs
the last steps first: ``out/model.pt`` is the same model on both peers, the run's. Writes it
and ``out/metrics.json`` (relative: in the peer's own folder).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from imdb import DATA, bag_of_words, reviews
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--data", type=Path, default=DATA, help="the offline data folder (with imdb/sample.parquet)")
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--out", type=Path, default=Path("out"))
args = parser.parse_args()

torch.manual_seed(0)
texts, labels = reviews("train", args.data)
train = TensorDataset(bag_of_words(texts), torch.tensor(labels))
test_texts, test_labels = reviews("test", args.data)
x_test, y_test = bag_of_words(test_texts), torch.tensor(test_labels)

model = torch.nn.Sequential(torch.nn.Linear(1024, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
loader = DataLoader(train, batch_size=args.batch_size, shuffle=True)

losses = []
for epoch in range(args.epochs):
    total = 0.0
    for x, y in loader:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        total += loss.item()
    losses.append(total / len(loader))
    print(f"epoch {epoch}: {len(loader)} steps, train loss {losses[-1]:.4f}", flush=True)

with torch.no_grad():
    accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
print(f"test accuracy {accuracy:.3f}")
args.out.mkdir(parents=True, exist_ok=True)
torch.save(model.state_dict(), args.out / "model.pt")
(args.out / "metrics.json").write_text(json.dumps({"train_loss": losses, "test_accuracy": accuracy}) + "\n")
