#!/usr/bin/env bash
# The checks that need a GPU, as one script for a lent GPU machine (python3 with a CUDA torch and
# pytorch-lightning installed; run from the repository root). Writes logs to ${OUT:-/tmp}.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
OUT=${OUT:-/tmp}
nvidia-smi -L
python3 -c "import torch, pytorch_lightning as pl; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.device_count(), 'pl', pl.__version__)"
echo "== tests/gpu (world of one over NCCL)"
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
echo "== 2 ranks on a host with fewer GPUs than ranks: gloo fallback (CPU tensors)"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/dist/test_collectives.py tests/dist/test_fusion.py 2>&1 | tail -6
echo "== hvdrun --check-build"
timeout 60 python3 -c "import sys; from hvd_trainer.launch.cli import main; sys.exit(main())" --check-build 2>&1 | tail -20
