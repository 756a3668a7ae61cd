"""A PyTorch Lightning module: the bag-of-words sentiment classifier, trained by ``L.Trainer``.

    python examples/lightning_module.py                                   # alone
    weightsync-run --local-peers 2 -- python examples/lightning_module.py   # 2 peers, same script

Nothing here knows about weightsync. Under ``weightsync-run`` the ``Trainer`` gets
``syncclient.lightning.SyncCallback`` when it is built, which syncs every ``--sync-every``
optimizer steps and once more when training ends (so the model saved afterwards is the same on
every peer), and the DataLoaders give each peer its share of the reviews (the validation one
too: each peer validates on its share). Writes ``out/model.pt`` and Lightning's CSV log and
checkpoint under ``out/logs/``, relative: in the peer's own folder.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import lightning as L
import torch
from imdb import DATA, bag_of_words, reviews
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--data", type=Path, default=DATA, help="the offline data folder (with imdb/sample.parquet)")
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--out", type=Path, default=Path("out"))
args = parser.parse_args()
logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # no banner about GPUs and TPUs


class Classifier(L.LightningModule):
    def __init__(self, lr: float = 3e-3) -> None:
        super().__init__()
        self.lr = lr
        self.net = torch.nn.Sequential(torch.nn.Linear(1024, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_acc", (self.net(x).argmax(1) == y).float().mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


torch.manual_seed(0)
texts, labels = reviews("train", args.data)
test_texts, test_labels = reviews("test", args.data)
train = DataLoader(TensorDataset(bag_of_words(texts), torch.tensor(labels)), args.batch_size, shuffle=True)
val = DataLoader(TensorDataset(bag_of_words(test_texts), torch.tensor(test_labels)), args.batch_size)

model = Classifier()
trainer = L.Trainer(
    max_epochs=args.epochs,
    accelerator="cpu",
    logger=CSVLogger(args.out / "logs"),
    log_every_n_steps=10,
    enable_progress_bar=False,
    enable_model_summary=False,
)
trainer.fit(model, train, val)
metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
print(f"after {trainer.global_step} steps: {metrics}")
torch.save(model.state_dict(), args.out / "model.pt")
(args.out / "metrics.json").write_text(json.dumps(metrics) + "\n")
