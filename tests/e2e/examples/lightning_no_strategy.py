"""Lightning 1.x habit: ``Trainer()`` with no ``strategy=`` in a job started by hvdrun, and no
``import hvd_trainer`` (a Lightning 1.x program had none: ``"horovod"`` was built in).

Lightning 1.x picked Horovod from the launcher's variables; hvd_trainer does the same when
``HOROVOD_RANK``/``HOROVOD_SIZE`` are set (hvdrun exports them) and says so on rank 0.
``--strategy NAME`` passes ``strategy=NAME`` instead.
"""

from __future__ import annotations

import os
import sys

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
import torch.utils.data as tud

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from standin import mnist, report  # noqa: E402


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(int(os.environ.get("RANK", "0")))  # rank-dependent: the strategy broadcasts
        self.fc = torch.nn.Linear(784, 10)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.fc(x.flatten(1)), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    x, y = mnist(128, seed=1)
    model = Net()
    strategy = sys.argv[sys.argv.index("--strategy") + 1] if "--strategy" in sys.argv else "auto"
    trainer = pl.Trainer(strategy=strategy, max_steps=3, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, tud.DataLoader(tud.TensorDataset(torch.from_numpy(x), torch.from_numpy(y)),
                                      batch_size=8))
    report("lightning_no_strategy", int(os.environ["RANK"]), strategy=type(trainer.strategy).__name__,
           world_size=trainer.world_size, horovod_size=os.environ.get("HOROVOD_SIZE"),
           hvd_trainer_imported="hvd_trainer.strategy" in sys.modules,
           weights=torch.cat([p.detach().flatten() for p in model.parameters()]).tolist())


if __name__ == "__main__":
    main()
