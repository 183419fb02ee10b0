"""What Horovod's examples/pytorch/pytorch_mnist.py does, with hvd_trainer's import line.

Conv net, SGD with momentum and the LR scaled by ``hvd.size()``, ``DistributedSampler`` over
``hvd.size()``/``hvd.rank()``, ``broadcast_parameters`` + ``broadcast_optimizer_state`` from rank
0, ``DistributedOptimizer(named_parameters=..., compression=fp16, op=Average,
gradient_predivide_factor=1.0)``, and a test loop that averages its metrics with
``hvd.allreduce(tensor, name=...)``.
"""

from __future__ import annotations

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.data as tud

import hvd_trainer.torch as hvd  # was: import horovod.torch as hvd

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from standin import mnist, report  # noqa: E402  (stands in for torchvision.datasets.MNIST)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, kernel_size=5)
        self.conv2 = nn.Conv2d(4, 8, kernel_size=5)
        self.fc1 = nn.Linear(128, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        x = F.relu(self.fc1(x.flatten(1)))
        return F.log_softmax(self.fc2(x), dim=1)


def metric_average(value: float, name: str) -> float:
    return hvd.allreduce(torch.tensor(value), name=name).item()


def main() -> None:
    hvd.init()
    torch.manual_seed(42)
    torch.set_num_threads(1)
    x, y = mnist(512, seed=1)
    train = tud.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    xt, yt = mnist(128, seed=2)
    test = tud.TensorDataset(torch.from_numpy(xt), torch.from_numpy(yt))
    train_sampler = tud.distributed.DistributedSampler(train, num_replicas=hvd.size(), rank=hvd.rank())
    test_sampler = tud.distributed.DistributedSampler(test, num_replicas=hvd.size(), rank=hvd.rank())
    train_loader = tud.DataLoader(train, batch_size=16, sampler=train_sampler)
    test_loader = tud.DataLoader(test, batch_size=32, sampler=test_sampler)

    torch.manual_seed(hvd.rank())  # different initial weights per rank: the broadcast must fix them
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size(), momentum=0.5)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(), compression=hvd.Compression.fp16,
        op=hvd.Average, gradient_predivide_factor=1.0,
    )
    losses: list[float] = []
    for epoch in range(1, 3):
        model.train()
        train_sampler.set_epoch(epoch)
        for batch_idx, (data, target) in enumerate(train_loader):
            optimizer.zero_grad()
            loss = F.nll_loss(model(data), target)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            if batch_idx % 8 == 0:
                seen = f"[{batch_idx * len(data)}/{len(train_sampler)}]"
                print(f"Train Epoch: {epoch} {seen}\tLoss: {loss.item():.6f}")
    model.eval()
    test_loss = correct = 0.0
    with torch.no_grad():
        for data, target in test_loader:
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            correct += output.argmax(1).eq(target).float().sum().item()
    test_loss = metric_average(test_loss / len(test_sampler), "avg_loss")
    accuracy = metric_average(correct / len(test_sampler), "avg_accuracy")
    if hvd.rank() == 0:
        print(f"Test set: Average loss: {test_loss:.4f}, Accuracy: {100.0 * accuracy:.2f}%")
    report("torch_mnist", hvd.rank(), losses=losses, test_loss=test_loss, accuracy=accuracy,
           weights=torch.cat([p.detach().flatten() for p in model.parameters()]).tolist())


if __name__ == "__main__":
    main()
