"""``Trainer(strategy="horovod")``: Lightning data parallelism over hvd_trainer's comm layer.

The LightningModule is not wrapped. Instead each trainable parameter gets a post-accumulate-grad
hook (:class:`~hvd_trainer.comm.GradientReducer`) that packs ready gradients into fused buckets and
starts an async allreduce per full bucket while backward continues. ``post_backward`` waits for all
buckets, so AMP unscaling, gradient clipping and ``optimizer.step()`` see the averaged gradient,
identically on every rank, exactly as in a single process with the global batch. The user's
optimizers, LR schedulers and checkpoints are untouched.

Example:
    >>> import hvd_trainer  # registers "horovod"
    >>> trainer = pl.Trainer(strategy="horovod", max_epochs=5)
    >>> trainer.fit(model, datamodule)       # under `hvdrun -np 4 python train.py`

``python train.py`` with ``devices=N`` and no launcher starts N-1 extra processes itself
(Lightning's script launcher, like ``strategy="ddp"``); under hvdrun, torchrun, mpirun or srun the
launcher's processes are used as they are.

Elastic mode (on by default under ``hvdrun --min-np/--max-np`` or ``--max-restarts N``): ``fit``
commits full checkpoints and, after torchrun restarted the workers, resumes from the last one by
itself, mid-epoch included; under ``hvdrun --recovery in-process`` the surviving workers continue
``fit`` in their processes and a restarted worker joins them at a commit (see
:mod:`hvd_trainer.lightning.elastic`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import weakref
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from lightning_fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning_utilities.core.rank_zero import rank_zero_only
from pytorch_lightning.accelerators import AcceleratorRegistry
from pytorch_lightning.plugins import TorchSyncBatchNorm
from pytorch_lightning.plugins.precision import Precision
from pytorch_lightning.strategies import ParallelStrategy, SingleDeviceStrategy, StrategyRegistry
from pytorch_lightning.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.distributed.nn.functional import all_gather as differentiable_all_gather
from typing_extensions import override

from hvd_trainer import comm
from hvd_trainer.comm import (
    AutoChoice,
    AutotuneConfig,
    Compressor,
    FusionConfig,
    GradientReducer,
    GradientSync,
    LocalSGDConfig,
    OuterArgs,
    OuterSync,
    ShardedGradientReducer,
    SyncOptions,
    World,
    ZeroSharding,
    flat_collective_,
    per_element,
    resolve_autotune,
    torchelastic_env,
)
from hvd_trainer.lightning._compat import (
    AcceleratorConnector,
    SubprocessScriptLauncher,
    attached_trainer,
    optimizers_to_device,
)
from hvd_trainer.lightning.cluster_env import HorovodEnvironment
from hvd_trainer.lightning.elastic import (
    ElasticFit,
    ElasticFitConfig,
    InProcessFitLauncher,
    align_joiner_callbacks,
    in_process_launch,
)
from hvd_trainer.lightning.plugins import HorovodSyncBatchNorm
from hvd_trainer.lightning.porting import install as install_porting_habits
from hvd_trainer.lightning.signals import install_sigterm_handler
from hvd_trainer.torch.zero_optimizer import ZeroStep

__all__ = ["HorovodStrategy", "StrategyConfigError", "UnevenBatchesError", "lightning_pytorch_strategy_class"]

log = logging.getLogger(__name__)


STRATEGY_DESCRIPTION = "hvd_trainer: Horovod-style fused allreduce on torch.distributed"


class StrategyConfigError(ValueError):
    """An invalid ``HorovodStrategy`` argument; the message names it and gives the fix."""


class UnevenBatchesError(RuntimeError):
    """Ranks would run different numbers of training steps per epoch.

    The rank with fewer batches would leave the epoch while the others still wait for it in the
    next gradient allreduce; the job would hang until the process-group timeout.
    """


class _HorovodStrategyLogic:
    """Everything of :class:`HorovodStrategy` except its Lightning base class, so the same logic
    serves ``pytorch_lightning`` and ``lightning.pytorch`` (two packages, two base classes).

    Data-parallel training with fused, backward-overlapped gradient allreduce.

    Every rank holds a full model replica. At ``setup`` the module state is broadcast from
    rank 0; during backward gradients are averaged over ranks in buckets of at most
    ``fusion_threshold_bytes``; Lightning's ``DistributedSampler`` gives each rank its shard.

    Args:
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin:
            injected by the Trainer, as for every Lightning strategy. ``cluster_environment``
            defaults to :class:`~hvd_trainer.lightning.cluster_env.HorovodEnvironment`.
        fusion_threshold_bytes: cap of one fused gradient bucket, bytes (``None``: the comm
            default, ``HOROVOD_FUSION_THRESHOLD`` or 16 MiB; 0 disables fusion).
        first_bucket_bytes: cap of the first bucket (last layers), bytes, so communication
            starts early in backward (``None``: the comm default, 1 MiB).
        autotune: search the bucket layout during the first steps and keep the fastest
            (:mod:`hvd_trainer.comm.reduce.autotune`): ``True``, an ``AutotuneConfig``, ``False``, or
            ``None`` (the default: ``HOROVOD_AUTOTUNE`` decides, as ``hvdrun --autotune`` sets it).
        timeout_seconds: timeout of process-group creation and of every collective, seconds.
        compression: wire format of gradient buckets: ``Compression.none`` (default),
            ``Compression.fp16``, ``Compression.bf16`` or the strings ``"none"``, ``"fp16"``,
            ``"bf16"``, or a ``Compressor`` subclass (:meth:`Compression.resolve`). Gradients are
            scaled before the cast, so fp16 does not overflow. The lossy ``Compression.int8`` /
            ``Compression.powersgd(rank=r)`` (``"int8"``, ``"powersgd:R"``) keep error-feedback
            residuals per parameter and rank; checkpoints hold every rank's (one allgather when a
            checkpoint is dumped) and a resume with the same world size restores each rank's.
            ``"auto"``: chosen from the measured link and the step's measured compute
            (:mod:`hvd_trainer.comm.reduce.auto`: all ranks on one host, plain allreduce at the
            start of ``fit``; across hosts the first 7 optimizer steps run plain and are timed,
            then the choice holds), printed on rank 0.
        scale_lr_by_world_size: multiply every optimizer's learning rate (and LR schedulers'
            ``base_lrs``) by the world size once at the start of fitting, and log it on rank 0;
            an elastic fit resumed in another world size rescales the restored rates to it.
            Off by default: hvd_trainer never changes hyperparameters silently.
        elastic: resume automatically after torchrun restarts the workers (see
            :mod:`hvd_trainer.lightning.elastic`): commit a full checkpoint every
            ``elastic_commit_every_n_steps`` optimizer steps and at each epoch end, and in a
            restarted attempt (``TORCHELASTIC_RESTART_COUNT > 0``) restore the last commit at the
            start of ``fit`` when no ``ckpt_path`` was given, mid-epoch included. Under
            ``hvdrun --recovery in-process`` a lost peer does not end ``fit``: the survivors
            re-form the world and continue from the newest commit in memory, and the restarted
            worker joins at a commit. ``None`` (default): on when torchrun may restart workers
            (``TORCHELASTIC_MAX_RESTARTS > 0``, i.e. ``hvdrun --min-np/--max-np`` or
            ``--max-restarts N``) or hvdrun asked for in-process recovery; ``True``/``False``: forced.
        elastic_checkpoint_dir: local directory of the commits (every node's local rank 0
            writes its copy). ``None``: ``<tmp>/hvd_trainer_elastic/<TORCHELASTIC_RUN_ID>``, or
            ``<default_root_dir>/hvd_elastic`` without a unique run id; removed after a normal
            end of ``fit``. An explicit directory keeps its last commit.
        elastic_commit_every_n_steps: optimizer steps between mid-epoch commits (each one
            writes the whole checkpoint: model, optimizer state, loops); 0: epoch ends only.
        sync_every: DiLoCo-style local steps (:mod:`hvd_trainer.comm.reduce.localsgd.outer`): no
            gradient is reduced; every rank steps its optimizer on its own batches and after
            every ``sync_every`` optimizer steps the ranks average their parameter change since
            the last outer step and an outer SGD applies it. ``None`` (default): synchronous
            data parallel. Needs exactly one optimizer. ``fit`` ends with an outer step when
            steps were taken since the last one, so the ranks end with equal weights;
            validation in between runs each rank's local weights (metrics averaged as usual).
            Checkpoints hold the anchors and outer momentum (global) next to rank 0's model
            and inner optimizer state; a resume gives every rank rank 0's.
            ``compression`` (``fp16``/``bf16``/``int8``) then narrows the outer gradient
            (``int8``: block-quantised allgather, no error feedback; ``powersgd`` is refused).
            ``"auto"``: chosen as ``compression="auto"`` above is (local steps in place of
            PowerSGD; the outer settings given here are kept).
        outer_lr, outer_momentum, outer_nesterov: the outer SGD (DiLoCo: 0.7, 0.9, True);
            ``sync_every=1, outer_lr=1.0, outer_momentum=0.0`` with SGD is synchronous.
        outer_overlap_steps: optimizer steps the outer gradient's allreduce may stay on the wire
            while training goes on (``0 <= n < sync_every``; 0, the default, blocks at every
            outer step); each rank then loads the new anchor plus its own progress since the
            launch (:mod:`hvd_trainer.comm.reduce.localsgd.outer`). Not with ``compression="int8"``.
            With ``outer_fragments``: ``n < sync_every / outer_fragments``.
        outer_fragments: with ``sync_every``: parts of the parameters (consecutive, of about
            equal size) with outer steps of their own, one part's launched every ``sync_every /
            outer_fragments`` optimizer steps, so each outer reduction moves ``1/outer_fragments``
            of the bytes (Streaming DiLoCo; :mod:`hvd_trainer.comm.reduce.localsgd.outer`). Must
            divide ``sync_every``; 1 (the default): all at once. Not with ``sync_every="auto"``.
        sync_warmup_steps: with ``sync_every``: optimizer steps at the start of training each
            followed by an average of the parameters, before local steps begin (``None``:
            128; 0: none, e.g. when fine-tuning; the synchronous warm-up of
            :mod:`hvd_trainer.comm.reduce.localsgd.outer`).
        zero_stage: ``0`` (default): every rank keeps the whole optimizer state. ``1``: each
            optimizer's state is sharded over the ranks (each parameter stepped by one owner,
            then exchanged); ``2``: the gradient buckets are also reduce-scattered, so after
            backward a rank holds only its parameters' gradients (one optimizer only). Gradient
            clipping by norm uses the global norm over all shards; checkpoints hold the full
            optimizer state (gathered on rank 0) and load at any world size. See
            :mod:`hvd_trainer.comm.zero`.
        zero_overlap_exchange: with ``zero_stage`` 1 or 2, the exchange of updated parameters
            runs on after ``optimizer_step`` and each bucket is finished just before the first
            module holding one of its parameters runs its next forward (it pays on a slow link).
            The strategy finishes it before a checkpoint or elastic commit reads the model,
            before validation, test and predict, and at the end of ``fit``; a callback that
            reads parameters in ``on_train_batch_end`` (an EMA of the weights, say) calls
            ``trainer.strategy.finish_parameter_exchange()`` first. Default ``False``.
        ddp_comm_state, ddp_comm_hook, ddp_comm_wrapper: a DDP communication hook, as Lightning's
            ``DDPStrategy`` takes it: each gradient bucket is reduced by
            ``ddp_comm_hook(ddp_comm_state, bucket)`` (``ddp_comm_wrapper(ddp_comm_hook)`` when a
            wrapper is given, e.g. ``fp16_compress_wrapper``) instead of the built-in allreduce,
            so the hooks of ``torch.distributed.algorithms.ddp_comm_hooks`` (``bf16_compress_hook``,
            ``powerSGD_hook`` with its ``PowerSGDState``) run unchanged; see
            :meth:`hvd_trainer.torch.DistributedOptimizer.register_comm_hook` for the bucket the
            hook gets (a parameter no rank produced a gradient for gets the hook's result, zeros,
            where DDP leaves ``None``). Not with ``compression``, ``sync_every``, ``zero_stage``
            or "auto"; ``PostLocalSGDState`` is refused (use ``sync_every``).

    Raises:
        StrategyConfigError: a negative byte size or timeout; a combination of the sync options
            that does not run (:class:`~hvd_trainer.comm.sync_options.SyncOptions`, the same
            checks as the torch and Keras ``DistributedOptimizer``): ``zero_stage`` not an int 0,
            1 or 2 (a str or bool included), or with ``sync_every``, an ``"auto"`` option or an
            error-feedback compression (2: or fp16); ``zero_overlap_exchange`` not a bool, or
            ``True`` without ``zero_stage``; an outer-loop argument away from its default
            without ``sync_every``; ``compression="auto"`` with an int ``sync_every``; at fit,
            ZeRO with several optimizers or parameters unfrozen during the fit;
            ``elastic`` not a bool or None;
            ``elastic_checkpoint_dir`` not a local path; ``elastic_commit_every_n_steps`` not
            an int >= 0; ``ddp_comm_hook`` with an option it would override, or not callable;
            ``ddp_comm_state``/``ddp_comm_wrapper`` without it; a ``PostLocalSGDState``.
        UnevenBatchesError: at the start of ``fit``, when ranks have different numbers of
            training batches per epoch (e.g. ``use_distributed_sampler=False`` with unequal
            shards), which would otherwise hang the job at the end of the first epoch; and at an
            epoch's end when shards of unknown length (``IterableDataset``) turn out unequal
            (the rank still training then gets a ``CollectiveMismatchError``).
    """

    strategy_name = "horovod"

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``"horovod"`` in ``strategy_registry`` (Lightning's ``_StrategyRegistry``).

        The Lightning 1.x habits (:mod:`hvd_trainer.lightning.porting`: ``Trainer()`` under
        hvdrun picks ``"horovod"``, ``accelerator="horovod"`` gets a HINT) are installed with it,
        by :func:`~hvd_trainer.lightning.porting.install` with the package's connector and registry.
        """
        strategy_registry.register(cls.strategy_name, cls, description=STRATEGY_DESCRIPTION)

    def __init__(
        self,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        *,
        fusion_threshold_bytes: int | None = None,
        first_bucket_bytes: int | None = None,
        autotune: bool | AutotuneConfig | None = None,
        timeout_seconds: float = 600.0,
        scale_lr_by_world_size: bool = False,
        compression: Compressor | type[Compressor] | str | None = None,
        elastic: bool | None = None,
        elastic_checkpoint_dir: str | os.PathLike[str] | None = None,
        elastic_commit_every_n_steps: int = 100,
        sync_every: int | str | None = None,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        outer_nesterov: bool = True,
        outer_overlap_steps: int = 0,
        outer_fragments: int = 1,
        sync_warmup_steps: int | None = None,
        zero_stage: int = 0,
        zero_overlap_exchange: bool = False,
        ddp_comm_state: object | None = None,
        ddp_comm_hook: Callable[..., Any] | None = None,
        ddp_comm_wrapper: Callable[..., Any] | None = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment or HorovodEnvironment(),
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        if timeout_seconds <= 0:
            raise StrategyConfigError(
                f"timeout_seconds={timeout_seconds!r} must be > 0. HINT: e.g. timeout_seconds=600."
            )
        self._fusion = _fusion_config(fusion_threshold_bytes, first_bucket_bytes, autotune)
        self._opts = SyncOptions.check(
            error=StrategyConfigError, compression=compression, zero_stage=zero_stage,
            zero_overlap_exchange=zero_overlap_exchange, sync_every=sync_every, names=_OUTER_NAMES,
            outer=OuterArgs(outer_lr=outer_lr, outer_momentum=outer_momentum, nesterov=outer_nesterov,
                            overlap_steps=outer_overlap_steps, fragments=outer_fragments,
                            sync_warmup_steps=sync_warmup_steps),
            comm_hook=None if ddp_comm_hook is None else "ddp_comm_hook", comm_state=ddp_comm_state,
        )
        self._sync = GradientSync(self._opts, world=self._require_world, fusion=self._fusion)
        self._sync.comm_hook = _comm_hook(ddp_comm_state, ddp_comm_hook, ddp_comm_wrapper)
        self._timeout_seconds = float(timeout_seconds)
        self._scale_lr = bool(scale_lr_by_world_size)
        self._scaled_optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._num_nodes = 1
        self._world: World | None = None
        self._autotune_reported = False  # the layout search's outcome was printed (rank 0)
        self._managed_ids: set[int] = set()
        self._sync_depth = 0  # > 0 inside block_backward_sync
        self._elastic_config = _elastic_config(elastic, elastic_checkpoint_dir, elastic_commit_every_n_steps)
        self._elastic: ElasticFit | None = None
        self._outer: OuterSync | None = None
        self._zero_stage = self._opts.zero_stage
        self._zero: dict[int, ZeroSharding] = {}  # id(optimizer) -> its sharding

    # -- topology ---------------------------------------------------------------------------
    @property
    def is_distributed(self) -> bool:
        """Always True: turns on Lightning's DistributedSampler and ``self.log(sync_dist=True)``."""
        return True

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        """Processes per node requested through ``Trainer(devices=...)`` (used for self-launch)."""
        return len(self.parallel_devices) if self.parallel_devices is not None else 1

    @property
    @override
    def root_device(self) -> torch.device:
        """``cuda:<local_rank>`` on GPU, ``cpu`` otherwise (not ``parallel_devices[local_rank]``,
        which does not exist when an external launcher started more ranks than ``devices``)."""
        if self._world is not None:
            return self._world.device
        if self.parallel_devices and self.parallel_devices[0].type == "cuda":
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @property
    @override
    def handles_gradient_accumulation(self) -> bool:
        """False: Lightning wraps accumulating micro-batches in :meth:`block_backward_sync`."""
        return False

    @property
    def reducer(self) -> GradientReducer | None:
        """The gradient reducer while fitting (``None`` otherwise)."""
        return self._sync.reducer

    @property
    def wire_bytes_sent(self) -> int:
        """Bytes this rank has sent for gradients and outer steps so far, over every ``fit`` of
        this strategy (readable after ``fit`` returns): the reducers'
        :attr:`~hvd_trainer.comm.GradientReducer.wire_bytes_sent` plus the local-steps outer
        loop's :attr:`~hvd_trainer.comm.OuterSync.bytes_sent`."""
        return self._sync.wire_bytes_sent + (0 if self._outer is None else self._outer.bytes_sent)

    @property
    @override
    def global_rank(self) -> int:
        """The comm world's rank once it exists (in-process recovery renumbers ranks), else the
        launcher's."""
        return self._world.rank if self._world is not None else super().global_rank

    @property
    @override
    def local_rank(self) -> int:
        return self._world.local_rank if self._world is not None else super().local_rank

    @property
    @override
    def node_rank(self) -> int:
        return self._world.cross_rank if self._world is not None else super().node_rank

    @property
    @override
    def world_size(self) -> int:
        """Processes in the comm world once it exists (in-process recovery may change it), else
        the launcher's count."""
        return self._world.size if self._world is not None else super().world_size

    def set_world_ranks(self) -> None:
        """Point Lightning's rank-zero utilities at this process's global rank."""
        rank_zero_only.rank = self.global_rank

    def follow_world(self, world: World) -> None:
        """Adopt ``world`` (re-formed by in-process recovery: ranks renumbered, size may differ):
        ranks, samplers and everything the next ``setup`` builds follow it (``"auto"`` still
        measuring starts again over it)."""
        self._world = world
        self.set_world_ranks()
        self._sync.follow_world()

    @property
    def elastic_fit(self) -> ElasticFit | None:
        """The running elastic fit's commit bookkeeping (``None`` outside an elastic ``fit``)."""
        return self._elastic

    # -- lifecycle --------------------------------------------------------------------------
    @override
    def _configure_launcher(self) -> None:
        env = self.cluster_environment
        assert env is not None
        if not env.creates_processes_externally and self.num_processes * self.num_nodes > 1:
            self._launcher = SubprocessScriptLauncher(env, self.num_processes, self.num_nodes)
        elif in_process_launch():
            self._launcher = InProcessFitLauncher(self)  # runs fit again after a lost peer
        else:
            self._launcher = None

    @override
    def setup_environment(self) -> None:
        env = self.cluster_environment
        # Lightning's self-launch exports no RANK: comm reads the environment's torchrun view
        environ = env.environ() if isinstance(env, HorovodEnvironment) else None
        self.set_world_ranks()
        device_type = self.parallel_devices[0].type if self.parallel_devices else "cpu"
        backend = "nccl" if device_type == "cuda" else "gloo"
        self._world = comm.init(backend=backend, timeout_seconds=self._timeout_seconds, environ=environ)
        self.set_world_ranks()  # a restarted worker's rank comes from the membership it joined
        super().setup_environment()
        trainer = attached_trainer(self.lightning_module)
        if trainer is not None and trainer.state.fn == "fit" and self.elastic and comm.in_process_recovery():
            survivor = self._elastic is not None and self._elastic.recovering
            align_joiner_callbacks(trainer, survivor=survivor, world=self._world)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        fitting = trainer.state.fn == "fit"
        install_sigterm_handler(trainer, self._require_world())  # before Lightning registers it
        previous, self._elastic = self._elastic, None
        if fitting and self.elastic:
            if previous is not None and previous.recovering:  # fit runs again after in-process recovery
                self._elastic = previous
                previous.world = self._require_world()
            else:
                self._elastic = ElasticFit(self._elastic_config, trainer, self._require_world())
            # before anything moves the model: a restored commit is loaded like fit(ckpt_path=...)
            self._elastic.start(trainer)
        self.accelerator.setup(trainer)
        if fitting and self._layer_sync is not None:
            if type(self._layer_sync) is TorchSyncBatchNorm:
                # Trainer(sync_batchnorm=True) installs torch's SyncBatchNorm, which refuses CPU
                # tensors; ours runs on gloo and NCCL and matches BatchNorm on the global batch.
                self._layer_sync = HorovodSyncBatchNorm()
            self.model = self._layer_sync.apply(self.model)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        _broadcast_module_state(self.model, self._require_world())
        if fitting:
            self.setup_optimizers(trainer)
            self._maybe_scale_lr()
            self._resolve_auto()
            if self._sync.local is None:
                self._attach_reducer()
                self._attach_zero()
            else:
                self._attach_outer()
        self.setup_precision_plugin()
        if fitting:
            optimizers_to_device(self.optimizers, self.root_device)

    @property
    def elastic(self) -> bool:
        """Whether ``fit`` commits and resumes (the ``elastic`` argument, or auto-detected)."""
        enabled = self._elastic_config.enabled
        if enabled is not None:
            return enabled
        return torchelastic_env().max_restarts > 0 or in_process_launch()

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """In elastic mode, the training loader becomes resumable mid-epoch (where exact)."""
        module = self.lightning_module
        if self._elastic is None or module is None:
            return dataloader
        return self._elastic.adapt_loader(dataloader, module.trainer)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """The elastic commit being resumed (already read and broadcast), else the file."""
        if self._elastic is not None and (loaded := self._elastic.take_loaded(checkpoint_path)) is not None:
            return loaded
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    def _attach_reducer(self) -> None:
        """(Re)build the reducer over every trainable parameter, keeping those it already
        managed even while they are frozen (``toggle_optimizer`` freezes them temporarily)."""
        module = self.lightning_module
        assert module is not None
        named = [
            (n, p) for n, p in module.named_parameters()
            if p.requires_grad or id(p) in self._managed_ids
        ]
        # ZeRO-2: one plan, made here (by elements for a per-element optimizer)
        zero = {"split": len(self.optimizers) == 1 and per_element(self.optimizers[0])} \
            if self._zero_stage == 2 else {}
        reducer = self._sync.build(named, sharded=self._zero_stage == 2, **zero)
        reducer.require_sync = self._sync_depth == 0
        self._managed_ids = {id(p) for _, p in named}

    def _resolve_auto(self) -> None:
        """``compression="auto"`` / ``sync_every="auto"``: start choosing
        (:meth:`~hvd_trainer.comm.GradientSync.start_auto`: on one host at once; across hosts the
        first optimizer steps run plain and are timed, then :meth:`optimizer_step` switches). A
        choice made in an earlier ``fit`` is kept."""
        if self._opts.auto_sync_every:
            self._check_one_optimizer("auto")
        module = self.lightning_module
        assert module is not None
        grad_bytes = sum(p.numel() * 4 for p in module.parameters() if p.requires_grad)
        self._sync.start_auto(grad_bytes, self.root_device)

    def _auto_step_end(self) -> None:
        """After an optimizer step while ``"auto"`` measures: count it; when it chose, switch to
        the choice (new buckets for a compressor; local steps: the outer loop from these
        parameters, equal on every rank after a synchronous step, and no gradient reducer)."""
        had_reducer = self._sync.reducer is not None
        if self._sync.step_end() is None:
            return
        if self._sync.local is not None and self._outer is None:
            self._attach_outer()
        elif had_reducer and self._sync.reducer is None:
            self._attach_reducer()

    @property
    def compression(self) -> Compressor:
        """The gradients' (with local steps: the outer gradient's) wire format in use
        (``Compression.none`` while ``"auto"`` measures)."""
        return self._sync.compression

    @property
    def local_steps(self) -> LocalSGDConfig | None:
        """The local-steps outer loop's settings (``sync_every`` given, or chosen by
        ``sync_every="auto"``), else ``None``."""
        return self._sync.local

    @property
    def auto_choice(self) -> str:
        """What the strategy runs now: ``"compression=<name>[, sync_every=H]"``."""
        return self._sync.describe()

    def _attach_outer(self) -> None:
        """Local steps: the outer loop over the module's trainable parameters (already equal on
        every rank: broadcast in ``setup``); no gradient reducer."""
        module = self.lightning_module
        local = self._sync.local
        assert module is not None and local is not None
        self._check_one_optimizer(local.sync_every)
        if self._outer is not None:  # replaced without a teardown (a re-formed world)
            self._sync.count_sent(self._outer.bytes_sent)
        self._outer = OuterSync(list(module.parameters()), local, world=self._require_world())

    def _check_one_optimizer(self, sync_every: int | str) -> None:
        if len(self.optimizers) != 1:
            raise StrategyConfigError(
                f"HorovodStrategy(sync_every={sync_every!r}) needs exactly one optimizer, "
                f"the module configures {len(self.optimizers)}. HINT: use one optimizer (param "
                "groups may differ), or sync_every=None for synchronous data parallel."
            )

    @property
    def outer(self) -> OuterSync | None:
        """The local-steps outer loop while fitting with ``sync_every`` (``None`` otherwise)."""
        return self._outer

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """The optimizer step; with ``sync_every``, every ``sync_every``-th also runs the outer
        step (a collective, the same step on every rank). With ZeRO the precision plugin steps
        a :class:`ZeroStep` view of ``optimizer`` (owned parameters stepped, then exchanged)."""
        zero = self._zero.get(id(optimizer))
        if zero is not None:
            optimizer = ZeroStep(optimizer, zero)
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._outer is not None:
            self._outer.after_inner_step()
        self._auto_step_end()
        return out

    @override
    def on_train_end(self) -> None:
        """Local steps: an outer step for the steps since the last one (equal weights at the end)."""
        self.finish_parameter_exchange()
        if self._outer is not None:
            self._outer.settle()
        super().on_train_end()

    def finish_parameter_exchange(self) -> None:
        """With ``zero_overlap_exchange=True``: finish the exchange of updated parameters the last
        optimizer step left running (every rank, at the same point); a no-op otherwise."""
        for zero in self._zero.values():
            zero.finish_exchange()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        self.finish_parameter_exchange()  # a checkpoint or elastic commit reads every parameter
        return super().lightning_module_state_dict()

    @override
    def on_validation_start(self) -> None:
        self.finish_parameter_exchange()
        super().on_validation_start()

    @override
    def on_test_start(self) -> None:
        self.finish_parameter_exchange()
        super().on_test_start()

    @override
    def on_predict_start(self) -> None:
        self.finish_parameter_exchange()
        super().on_predict_start()

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The optimizer's ``state_dict``; the first optimizer's also carries the local-steps state
        under the key ``"hvd_trainer"`` (removed again by :meth:`load_optimizer_state_dict`).
        With ZeRO: the full state on global rank 0, ``{}`` elsewhere (a collective)."""
        state = self._gathered_optimizer_state(optimizer)
        extra = self._extra_training_state()
        if extra and self.optimizers and _unwrap(optimizer) is _unwrap(self.optimizers[0]):
            state = {**state, _EXTRA_KEY: extra}
        return state

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        states = [dict(s) for s in checkpoint["optimizer_states"]]
        extras = [s.pop(_EXTRA_KEY, None) for s in states]
        self._load_optimizer_states({**checkpoint, "optimizer_states": states})
        extra = next((e for e in extras if e), None)
        if extra is not None:
            self._load_extra_training_state(extra)

    def _extra_training_state(self) -> dict[str, Any]:
        """Local steps' outer state; error-feedback residuals of *every* rank (one allgather:
        checkpoints are dumped on every rank, written by rank 0)."""
        extra: dict[str, Any] = {}
        if self._outer is not None:
            extra["local_steps"] = self._outer.state_dict()
        feedback = self._sync.compression_state_dict()
        if feedback is not None:
            extra["compression_per_rank"] = comm.allgather_object(feedback, world=self._require_world())
        return extra

    def _load_extra_training_state(self, extra: dict[str, Any]) -> None:
        if self._sync.auto_measuring and self._opts.auto_sync_every and "local_steps" in extra:
            # saved after "auto" chose local steps: take up that period, do not measure again
            h = int(extra["local_steps"]["sync_every"])
            self._sync.adopt(AutoChoice(self._sync.compression, h, "restored from the checkpoint"))
            self._attach_outer()
        if self._outer is not None and "local_steps" in extra:
            self._outer.load_state_dict(extra["local_steps"])
        per_rank = extra.get("compression_per_rank")
        if per_rank is None or not self._sync.compression.error_feedback:
            return
        if len(per_rank) != self.world_size:
            rank_zero_info(
                f"hvd_trainer: the checkpoint holds error-feedback residuals of {len(per_rank)} ranks, "
                f"this run has {self.world_size}; residuals start from zero."
            )
            return
        self._sync.load_compression_state_dict(per_rank[self.global_rank])

    def _has_new_trainable_params(self) -> bool:
        module = self.lightning_module
        assert module is not None
        managed = self._managed_ids
        return any(p.requires_grad and id(p) not in managed for p in module.parameters())

    def _maybe_scale_lr(self) -> None:
        if not self._scale_lr:
            return
        size = self.world_size
        for optimizer in self.optimizers:
            if optimizer in self._scaled_optimizers:  # never scale the same optimizer twice
                continue
            self._scaled_optimizers.add(optimizer)
            _scale_rates(optimizer, size)
        for config in self.lr_scheduler_configs:
            _scale_scheduler(config.scheduler, size, ("base_lrs",))
        rank_zero_info(
            f"hvd_trainer: scale_lr_by_world_size=True, learning rates multiplied by {size}."
        )

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # -- ZeRO -------------------------------------------------------------------------------
    def _attach_zero(self) -> None:
        """Shard each optimizer's state (``zero_stage`` 1/2) over the trainable parameters."""
        for old in self._zero.values():
            old.restore_param_groups()
        self._zero = {}
        if not self._zero_stage:
            return
        module = self.lightning_module
        assert module is not None and self.reducer is not None
        if self._zero_stage == 2 and len(self.optimizers) != 1:
            raise StrategyConfigError(
                f"zero_stage=2 reduce-scatters one set of buckets to the owners of one optimizer, "
                f"but configure_optimizers returned {len(self.optimizers)}. HINT: use zero_stage=1 "
                "with several optimizers."
            )
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        for optimizer in self.optimizers:
            ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
            mine = named if self._zero_stage == 2 else [(n, p) for n, p in named if id(p) in ids]
            # stage 2: the reducer planned (it was built first, by elements when it can be)
            plan = self.reducer.plan if isinstance(self.reducer, ShardedGradientReducer) else None
            zero = self._sync.shard(mine, optimizer, plan=plan)
            assert zero is not None
            self._zero[id(optimizer)] = zero
        if self._zero_stage == 2:
            self._clip_by_global_norm()

    def _clip_by_global_norm(self) -> None:
        """Stage 2: the precision plugin's clipping by norm uses the global norm over all shards
        (a rank holds only its own gradients, so torch's clip over ``param_groups`` would see a
        part). Set on this plugin instance; removed at teardown."""
        plugin = self.precision_plugin
        original = type(plugin).clip_grad_by_norm
        zeros = self._zero

        def clip_grad_by_norm(optimizer: torch.optim.Optimizer, clip_val: float) -> None:
            inner = optimizer.optimizer if isinstance(optimizer, ZeroStep) else optimizer
            zero = zeros.get(id(inner))
            if zero is None:
                original(plugin, optimizer, clip_val)
            else:
                zero.clip_grad_norm_(float(clip_val))

        plugin.clip_grad_by_norm = clip_grad_by_norm  # type: ignore[method-assign]

    def _gathered_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """With ZeRO: the full state gathered on global rank 0 (``{}`` on the others), as
        Lightning does for torch's ZeroRedundancyOptimizer; with in-process recovery on every
        rank (each keeps its own commit, and a survivor plans the shards of the new world from
        it); a collective. Else Lightning's."""
        inner = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer's
        zero = self._zero.get(id(inner))
        if zero is None:
            return super().optimizer_state(optimizer)
        everywhere = self._elastic is not None and self._elastic.in_process
        zero.consolidate(inner, to=None if everywhere else 0)
        return zero.pop_state_dict() if everywhere or self.is_global_zero else {}

    def _load_optimizer_states(self, checkpoint: Any) -> None:
        """With ZeRO: each rank keeps its own parameters' part of the full state (written at
        any world size). Else Lightning's."""
        if not self._zero:
            return super().load_optimizer_state_dict(checkpoint)
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"], strict=False):
            zero = self._zero.get(id(optimizer))
            if zero is None:
                optimizer.load_state_dict(state)
            else:
                zero.load_state_dict(optimizer, state)
        optimizers_to_device(self.optimizers, self.root_device)
        return None

    @override
    def teardown(self) -> None:
        for zero in self._zero.values():  # finished by on_train_end unless fit raised
            zero.abandon_exchange()
            zero.restore_param_groups()
        self._zero = {}
        if self.precision_plugin is not None:
            vars(self.precision_plugin).pop("clip_grad_by_norm", None)
        self._sync.release()
        if self._outer is not None:
            self._sync.count_sent(self._outer.bytes_sent)
        self._outer = None
        self._managed_ids = set()
        module = self.lightning_module
        trainer = attached_trainer(module)
        if self._layer_sync is not None and trainer is not None and trainer.state.fn == "fit":
            self.model = self._layer_sync.revert(self.model)  # undo setup's apply, as DDP does
        super().teardown()

    @override
    def on_train_start(self) -> None:
        """Refuse to train when ranks have different numbers of training batches per epoch; a
        resumed elastic fit restores a mid-epoch commit's RNG states here."""
        trainer = attached_trainer(self.lightning_module)
        if trainer is not None:  # a new check each fit: the world may have been re-formed since the last
            trainer.callbacks = [cb for cb in trainer.callbacks if not isinstance(cb, _EpochEndCheck)]
        if trainer is not None and self.world_size > 1:
            _check_equal_batches(trainer, self._require_world())
            trainer.callbacks.append(_EpochEndCheck(self._require_world()))
        if self._elastic is not None:
            self._elastic.restore_rng(before_loader=False)
            self._rescale_restored_lr()
        super().on_train_start()

    def _rescale_restored_lr(self) -> None:
        """``scale_lr_by_world_size`` after an elastic resume in another world size: the restored
        optimizer and scheduler states hold rates scaled by the commit's world size; scale them by
        this world's instead (``lr * new / old``, also ``initial_lr``, ``base_lrs``, last rates)."""
        assert self._elastic is not None
        old, self._elastic.resumed_world_size = self._elastic.resumed_world_size, None
        if not self._scale_lr or old is None or old == self.world_size:
            return
        ratio = self.world_size / old
        for optimizer in self.optimizers:
            _scale_rates(optimizer, ratio)
        for config in self.lr_scheduler_configs:
            _scale_scheduler(config.scheduler, ratio, ("base_lrs", "_last_lr"))
        rank_zero_info(f"hvd_trainer: scale_lr_by_world_size=True, the commit was taken on {old} "
                       f"rank(s), this world has {self.world_size}: learning rates scaled by "
                       f"{self.world_size}/{old}.")

    # -- backward ---------------------------------------------------------------------------
    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        """Pick up parameters unfrozen since setup (e.g. by ``BackboneFinetuning``).

        Freezing is deterministic, so every rank rebuilds the same buckets at the same step.
        """
        if self.reducer is not None and self._has_new_trainable_params():
            if self._zero:
                raise StrategyConfigError(
                    f"zero_stage={self._zero_stage}: parameters were unfrozen during the fit, but "
                    "the shard plan covers the parameters trainable at setup. HINT: unfreeze "
                    "before fit, or use zero_stage=0 with BackboneFinetuning-style unfreezing."
                )
            log.info("hvd_trainer: parameters were unfrozen; rebuilding gradient buckets")
            self._attach_reducer()

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        """Wait for this step's gradient buckets (before unscale and clipping)."""
        reducer = self.reducer
        if reducer is not None and reducer.require_sync:
            with self._sync.waiting():
                reducer.wait()
            tuner = reducer.autotuner
            if tuner is not None and tuner.done and not self._autotune_reported:
                self._autotune_reported = True
                rank_zero_info(tuner.summary())
            for zero in self._zero.values():  # stage 2: owned pieces' gradients; AMP's skip
                zero.after_reduction(reducer)  # decision agrees on every rank

    @override
    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Accumulate gradients locally, sending nothing (gradient accumulation). Nests."""
        self._sync_depth += 1
        if self.reducer is not None:
            self.reducer.require_sync = False
        try:
            yield
        finally:
            self._sync_depth -= 1
            if self.reducer is not None:  # the reducer may have been rebuilt inside
                self.reducer.require_sync = self._sync_depth == 0

    # -- collectives ------------------------------------------------------------------------
    @override
    def reduce(
        self,
        tensor: Tensor | Any,
        group: Any | None = None,
        reduce_op: comm.ReduceOp | dist.ReduceOp | str | None = "mean",
    ) -> Tensor | Any:
        """Reduce ``tensor`` over ranks; non-tensors are returned unchanged.

        Floating tensors are reduced in place (as Lightning's DDP does); an integer ``"mean"``
        returns a new float tensor. ``reduce_op``: ``"mean"``/``"avg"``, ``"sum"``, ``"min"``,
        ``"max"``, a :class:`torch.distributed.ReduceOp` or an hvd_trainer op.

        Raises:
            StrategyConfigError: ``group`` is a process group other than the world.
        """
        if not isinstance(tensor, Tensor):
            return tensor
        _check_group(group)
        op = comm.to_reduce_op(reduce_op)
        world = self._require_world()
        if op is comm.Average and not (tensor.is_floating_point() or tensor.is_complex()):
            tensor = tensor.to(torch.get_default_dtype())
        return comm.allreduce_(tensor, op=op, world=world)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """Stack every rank's ``tensor`` (same shape everywhere): shape ``[world_size, *shape]``."""
        _check_group(group)
        if sync_grads:
            return _all_gather_with_grads(tensor)
        return comm.allgather(tensor.unsqueeze(0), world=self._require_world())

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Return rank ``src``'s (picklable) ``obj`` on every rank."""
        return comm.broadcast_object(obj, src, world=self._require_world())

    @override
    def barrier(self, name: str | None = None, *args: Any, **kwargs: Any) -> None:
        if self._world is None and not comm.is_initialized():
            return
        comm.barrier(world=self._require_world())

    def _require_world(self) -> World:
        if self._world is None:
            self._world = comm.get_world()
        return self._world


class HorovodStrategy(_HorovodStrategyLogic, ParallelStrategy):
    """Data-parallel Lightning strategy ``"horovod"`` for ``pytorch_lightning`` (see
    :class:`_HorovodStrategyLogic` for arguments and behaviour)."""


@functools.cache
def lightning_pytorch_strategy_class() -> type:
    """The same strategy for the ``lightning`` package's ``lightning.pytorch`` namespace.

    Raises:
        ModuleNotFoundError: ``lightning`` is not installed.
    """
    from lightning.pytorch.strategies import ParallelStrategy as LightningParallelStrategy

    class LightningHorovodStrategy(_HorovodStrategyLogic, LightningParallelStrategy):
        """``Trainer(strategy="horovod")`` for ``lightning.pytorch``."""

    return LightningHorovodStrategy


def _check_equal_batches(trainer: pl.Trainer, world: World) -> None:
    """Raise :class:`UnevenBatchesError` on every rank when the per-rank count of training
    batches per epoch differs in a way that matters (one allgather of a float64 scalar).

    Counts that are infinite (an ``IterableDataset`` without ``__len__``) cannot be compared and
    are skipped; a ``max_steps`` reached before the shortest rank's epoch ends is harmless.
    """
    mine = torch.tensor([float(trainer.num_training_batches)], dtype=torch.float64)
    counts = comm.allgather(mine, name="hvd_trainer.num_training_batches", world=world).tolist()
    if any(c == float("inf") for c in counts) or min(counts) == max(counts):
        return
    stop = trainer.max_steps * trainer.accumulate_grad_batches
    if 0 <= stop <= min(counts):  # max_steps ends training inside the first epoch
        return
    per_rank = ", ".join(f"rank {r}: {int(c)}" for r, c in enumerate(counts))
    raise UnevenBatchesError(
        f"ranks have different numbers of training batches per epoch ({per_rank}); the rank with "
        "fewer batches would leave the epoch while the others wait for it in the next gradient "
        "allreduce. HINT: keep Trainer(use_distributed_sampler=True) (its DistributedSampler gives "
        "every rank an equal-length shard), give each rank an equal-length shard yourself "
        "(DistributedSampler(drop_last=True) or equal dataset sizes), or cap every rank with "
        f"Trainer(limit_train_batches={int(min(counts))})."
    )


class _EpochEndCheck(pl.Callback):
    """At each training-epoch end, compare the batches every rank ran in this epoch.

    Catches what the start-of-fit check cannot see: shards of unknown length (an
    ``IterableDataset``) or loaders reloaded per epoch. A rank that ends its epoch while another
    still waits in a gradient allreduce meets it here: the cross-rank check then raises on both
    (a mismatch naming this collective and the gradient bucket) instead of pairing one rank's
    next-epoch gradients with the other's current ones. One 8-byte allgather per epoch.
    """

    def __init__(self, world: World) -> None:
        self.world = world

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        ran = trainer.fit_loop.epoch_loop.batch_progress.current.ready
        mine = torch.tensor([float(ran)], dtype=torch.float64)
        counts = comm.allgather(mine, name="hvd_trainer.train_epoch_end", world=self.world).tolist()
        if min(counts) != max(counts):
            per_rank = ", ".join(f"rank {r}: {int(c)}" for r, c in enumerate(counts))
            raise UnevenBatchesError(
                f"ranks ran different numbers of training batches in epoch {trainer.current_epoch} "
                f"({per_rank}): their gradients were averaged with other ranks' batches. HINT: "
                "give every rank the same number of batches per epoch (equal-length shards, "
                "DistributedSampler(drop_last=True), or Trainer(limit_train_batches=...))."
            )


def _comm_hook(state: object | None, hook: Callable[..., Any] | None,
               wrapper: Callable[..., Any] | None) -> tuple[object | None, Callable[..., Any]] | None:
    """``(state, hook)`` from Lightning ``DDPStrategy``'s three arguments (``wrapper(hook)`` when a
    wrapper is given), or ``None`` without a hook."""
    if hook is None:
        if state is not None or wrapper is not None:
            given = "ddp_comm_state" if state is not None else "ddp_comm_wrapper"
            raise StrategyConfigError(f"{given} given without ddp_comm_hook: it would change nothing. "
                                      "HINT: add ddp_comm_hook=..., or drop it.")
        return None
    for name, fn in (("ddp_comm_hook", hook), ("ddp_comm_wrapper", wrapper)):
        if fn is not None and not callable(fn):
            raise StrategyConfigError(f"{name}={fn!r:.80} is not callable. HINT: pass a function, e.g. "
                                      "torch.distributed.algorithms.ddp_comm_hooks.default_hooks."
                                      "bf16_compress_hook.")
    if wrapper is not None:
        rank_zero_info(f"DDP comm wrapper is provided, apply {getattr(wrapper, '__qualname__', wrapper)}"
                       f"({getattr(hook, '__qualname__', hook)}).")
        hook = wrapper(hook)
    return state, hook


def _fusion_config(threshold: int | None, first: int | None,
                   autotune: bool | AutotuneConfig | None = None) -> FusionConfig:
    kwargs: dict[str, Any] = {}
    if autotune is not None:
        try:
            kwargs["autotune"] = resolve_autotune(autotune)
        except TypeError as exc:
            raise StrategyConfigError(str(exc)) from None
    for name, value in (("fusion_threshold_bytes", threshold), ("first_bucket_bytes", first)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise StrategyConfigError(
                f"{name}={value!r} must be an int >= 0 (bytes). HINT: {name}={64 * 1024 * 1024}."
            )
        kwargs[name] = value
    return FusionConfig(**kwargs)


_EXTRA_KEY = "hvd_trainer"
"""Key of the strategy's own training state (local steps, error feedback) in the first
optimizer's entry of a checkpoint's ``optimizer_states``."""


def _unwrap(optimizer: Any) -> Any:
    return getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer's optimizer


_OUTER_NAMES = {"nesterov": "outer_nesterov", "overlap_steps": "outer_overlap_steps",
                "fragments": "outer_fragments"}
"""The strategy's names of the outer-loop arguments whose ``OuterArgs`` names differ."""


def _elastic_config(
    enabled: bool | None, directory: str | os.PathLike[str] | None, every: int
) -> ElasticFitConfig:
    if enabled is not None and not isinstance(enabled, bool):
        raise StrategyConfigError(
            f"elastic={enabled!r} must be True, False or None (auto). HINT: elastic=True."
        )
    if directory is not None and (not isinstance(directory, (str, os.PathLike)) or "://" in str(directory)):
        raise StrategyConfigError(
            f"elastic_checkpoint_dir={directory!r} must be a local directory path. "
            "HINT: elastic_checkpoint_dir='runs/exp1/elastic' (a shared file system works too)."
        )
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        raise StrategyConfigError(
            f"elastic_commit_every_n_steps={every!r} must be an int >= 0 (optimizer steps; "
            "0: epoch ends only). HINT: elastic_commit_every_n_steps=100."
        )
    return ElasticFitConfig(enabled=enabled, checkpoint_dir=None if directory is None else Path(directory),
                            commit_every_n_steps=every)


def _all_gather_with_grads(tensor: Tensor) -> Tensor:
    """Differentiable allgather over the world, shape ``[world_size, *shape]`` (what Lightning's
    DDP strategy runs; ``tensor`` itself while ``torch.distributed`` is not initialised, as there)."""
    if not dist.is_initialized():
        return tensor
    # group= given at each call: torch's default (group.WORLD) is bound when its module is first
    # imported, i.e. to the world then current, which a re-formed world has destroyed.
    group = dist.group.WORLD
    # contiguous: pytorch#73515
    return torch.stack(differentiable_all_gather(tensor.contiguous(), group=group))


def _check_group(group: Any | None) -> None:
    if group is None or group is dist.group.WORLD:
        return
    raise StrategyConfigError(
        f"HorovodStrategy collectives run over the whole world; got group={group!r}. "
        "HINT: pass group=None."
    )


def _broadcast_module_state(module: torch.nn.Module, world: World, root_rank: int = 0) -> None:
    """Overwrite every parameter and buffer with ``root_rank``'s values.

    Tensors are flattened per (device, dtype) (:mod:`hvd_trainer.comm.ops.flatten`) so the
    broadcast is one collective per group, not one per tensor.
    """
    if world.size == 1:
        return
    flat_collective_(
        [*module.parameters(), *module.buffers()],
        lambda flat: comm.broadcast_(flat, root_rank, world=world),
        what="broadcast of the module state",
    )


# Importing this module imports Lightning, whose import hook (hvd_trainer._register) skips
# pytorch_lightning while this class does not exist yet; so the strategy registers itself here.
if "horovod" not in StrategyRegistry:
    HorovodStrategy.register_strategies(StrategyRegistry)
install_porting_habits(AcceleratorConnector, AcceleratorRegistry, SingleDeviceStrategy)


def _scale_rates(optimizer: torch.optim.Optimizer, factor: float) -> None:
    """Multiply every param group's ``lr`` (and ``initial_lr``, a scheduler's start) by ``factor``."""
    for group in optimizer.param_groups:
        group["lr"] *= factor
        if "initial_lr" in group:
            group["initial_lr"] *= factor


def _scale_scheduler(scheduler: Any, factor: float, attrs: tuple[str, ...]) -> None:
    """Multiply the scheduler's rate lists named in ``attrs`` (e.g. ``base_lrs``) by ``factor``."""
    for attr in attrs:
        rates = getattr(scheduler, attr, None)
        if isinstance(rates, list):
            setattr(scheduler, attr, [lr * factor for lr in rates])
