"""Which interface carries the collectives: ``IFACE <rank> {"eth0": bytes, "eth1": bytes}``.

Counts the bytes each interface of this host sent during 4 allreduces of 16 MiB
(``/sys/class/net/<if>/statistics/tx_bytes``; ``ip netns exec`` mounts the host's own sysfs).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

import hvd_trainer.torch as hvd

ROUNDS, ELEMENTS = 4, 4 * 1024 * 1024  # float32: 16 MiB per allreduce


def _sent() -> dict[str, int]:
    root = Path("/sys/class/net")
    return {p.name: int((p / "statistics" / "tx_bytes").read_text()) for p in root.iterdir()
            if p.name.startswith("eth")}


def main() -> None:
    hvd.init()
    hvd.allreduce(torch.ones(16))  # connections made before counting
    before = _sent()
    for _ in range(ROUNDS):
        out = hvd.allreduce(torch.ones(ELEMENTS), op=hvd.Sum)
    after = _sent()
    assert float(out[0]) == hvd.size()
    print(f"IFACE {hvd.rank()} {json.dumps({k: after[k] - before[k] for k in sorted(after)})}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
