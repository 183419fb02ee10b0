"""SyncBatchNorm without a process group (a world of one) and layer conversion."""

from __future__ import annotations

import copy

import torch
from pytorch_lightning.plugins.layer_sync import _BatchNormXd

from hvd_trainer.lightning.plugins import HorovodSyncBatchNorm
from hvd_trainer.torch.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(2, 3, 3), torch.nn.BatchNorm2d(3),
        torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 4), torch.nn.BatchNorm1d(4)),
    )


def test_world_of_one_equals_batchnorm_train_and_eval() -> None:
    ref = _net()
    net = convert_sync_batchnorm(copy.deepcopy(ref))
    assert isinstance(net[1], SyncBatchNorm) and isinstance(net[2][2], SyncBatchNorm)
    x = torch.randn(5, 2, 4, 4)
    for _ in range(2):
        assert torch.equal(net(x), ref(x))
    assert torch.equal(net[1].running_var, ref[1].running_var)
    net.eval()
    ref.eval()
    assert torch.equal(net(x), ref(x))


def test_layer_sync_plugin_converts_and_reverts() -> None:
    net = _net()
    weight = net[1].weight
    plugin = HorovodSyncBatchNorm()
    synced = plugin.apply(net)
    assert type(synced[1]) is SyncBatchNorm and synced[1].weight is weight
    reverted = plugin.revert(synced)
    assert type(reverted[1]) is _BatchNormXd and reverted[1].weight is weight


def test_a_given_world_is_kept_and_shared_by_conversion() -> None:
    from hvd_trainer.comm.world.world import World

    world = World(rank=0, size=1, local_rank=0, local_size=1, cross_rank=0, cross_size=1,
                  device=torch.device("cpu"), backend="gloo")
    ref = _net()
    net = convert_sync_batchnorm(copy.deepcopy(ref), world=world)
    assert net[1].world is world and net[2][2].world is world
    x = torch.randn(5, 2, 4, 4)
    assert torch.equal(net(x), ref(x))  # a world of one: plain batch norm
    assert copy.deepcopy(net)[1].world is world
    assert SyncBatchNorm(3).world is None  # resolved at the first training forward, not before
