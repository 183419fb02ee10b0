"""Horovod's examples/pytorch/pytorch_mnist.py as a Horovod user has it: *no* line changed for
hvd_trainer. Run with ``hvdrun --as-horovod -np 2 python horovod_pytorch_mnist.py``, or
``python horovod_pytorch_mnist.py --num-proc 2`` (``horovod.run``) in a process that imported
``hvd_trainer.horovod_alias`` first.

Beyond the example's ``import horovod`` / ``import horovod.torch as hvd`` it imports two of
Horovod's submodules the way other Horovod scripts do, so the test sees them resolve.
"""

import argparse
import sys

import horovod
import horovod.torch as hvd
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.data as tud
from horovod.common.exceptions import HorovodInternalError  # noqa: F401
from horovod.torch.mpi_ops import allreduce  # noqa: F401

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from standin import mnist, report  # noqa: E402  (stands in for torchvision.datasets.MNIST)

parser = argparse.ArgumentParser(description="PyTorch MNIST Example")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--num-proc", type=int)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, kernel_size=5)
        self.conv2 = nn.Conv2d(4, 8, kernel_size=5)
        self.fc1 = nn.Linear(128, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        x = F.relu(self.fc1(x.flatten(1)))
        return F.log_softmax(self.fc2(x), dim=1)


def metric_average(val, name):
    return hvd.allreduce(torch.tensor(val), name=name).item()


def main(args):
    hvd.init()
    torch.manual_seed(42)
    torch.set_num_threads(1)
    x, y = mnist(512, seed=1)
    train_dataset = tud.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    train_sampler = tud.distributed.DistributedSampler(
        train_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    train_loader = tud.DataLoader(train_dataset, batch_size=16, sampler=train_sampler)

    torch.manual_seed(hvd.rank())  # different initial weights per rank: the broadcast must fix them
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size(), momentum=0.5)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=hvd.Compression.fp16, op=hvd.Average)
    losses = []
    for epoch in range(1, args.epochs + 1):
        model.train()
        train_sampler.set_epoch(epoch)
        for batch_idx, (data, target) in enumerate(train_loader):
            optimizer.zero_grad()
            loss = F.nll_loss(model(data), target)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            if batch_idx % 8 == 0:
                print(f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_sampler)}]\t"
                      f"Loss: {loss.item():.6f}")
    avg = metric_average(losses[-1], "avg_loss")
    if hvd.rank() == 0:
        print(f"Average last loss: {avg:.4f} (horovod module: {hvd.__name__})")
    report("horovod_pytorch_mnist", hvd.rank(), losses=losses, avg=avg, module=hvd.__name__,
           weights=torch.cat([p.detach().flatten() for p in model.parameters()]).tolist())
    return hvd.rank()


if __name__ == "__main__":
    args = parser.parse_args()
    if args.num_proc:
        # run training through horovod.run
        print("Running training through horovod.run")
        print("RANKS", horovod.run(main, args=(args,), np=args.num_proc, use_gloo=True))
    else:
        main(args)
