"""The GPT recipe on GPUs: nanoGPT's Shakespeare size (10.8M parameters), bf16 autocast.

Same schema, data and code as ``recipes/gpt.py``; only the settings differ (``conf/gpt_gpu.yaml``).

    hvd-train recipe=gpt_gpu                      # one GPU
    hvdrun -np 8 hvd-train recipe=gpt_gpu         # 8 GPUs of one node (NCCL)
    hvdrun -np 16 -H h1:8,h2:8 hvd-train recipe=gpt_gpu   # the same line on h1 and h2
"""

from __future__ import annotations

from .gpt import Config, run

__all__ = ["Config", "run"]
