"""Compression.resolve: the one resolver of ``compression=`` (comm, the Lightning strategy and the
torch DistributedOptimizer here; the Keras front end in test_keras_arguments.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import hvd_trainer.comm as comm
from hvd_trainer.comm.ops.compression import (
    DEFAULT_POWERSGD_RANK,
    DEFAULT_POWERSGD_WARMUP_STEPS,
    BF16Compressor,
    Compression,
    CompressionError,
    Compressor,
    FP16Compressor,
    NoneCompressor,
    compression_spellings,
)
from hvd_trainer.comm.reduce.auto import decide
from hvd_trainer.comm.reduce.compressed import FeedbackState, merge_feedback, rename_feedback
from hvd_trainer.comm.reduce.link_probe import LinkEstimate
from hvd_trainer.comm.world.world import World


class WireOnly(Compressor):
    """A user compressor that only chooses the wire dtype: honoured."""

    name = "my_bf16"
    wire_dtype = torch.bfloat16


class OwnCast(Compressor):
    """A Horovod-style compressor with its own compress/decompress: the allreduce cannot call it."""

    name = "own"

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor.to(torch.float16), tensor.dtype

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor.to(ctx)


class OwnDecompress(Compressor):
    name = "own_decompress"

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class Int8Wire(Compressor):
    name = "int8"
    wire_dtype = torch.int8


class HorovodStyle:
    """Duck-typed (not a Compressor): rejected."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


ACCEPTED = [
    (None, Compression.none),
    ("none", Compression.none),
    ("fp16", Compression.fp16),
    ("bf16", Compression.bf16),
    ("FP16", Compression.fp16),
    (Compression.none, Compression.none),
    (Compression.fp16, Compression.fp16),
    (Compression.bf16, Compression.bf16),
]

REJECTED = [
    ("powersgd:x", "expected 'powersgd' or 'powersgd:R'"),
    (16, "compression=16 is not a compressor"),
    (torch.float16, "compression=torch.float16 is not a compressor"),
    (HorovodStyle, "is not a compressor"),
    (HorovodStyle(), "is not a compressor"),
    (OwnCast, "overrides compress/decompress()"),
    (OwnCast(), "overrides compress/decompress()"),
    (OwnDecompress(), "overrides decompress()"),
    (Int8Wire, "wire_dtype=torch.int8"),
]


@pytest.mark.parametrize(("value", "expected"), ACCEPTED)
def test_resolve_accepts_names_and_instances(value: Any, expected: Compressor) -> None:
    assert Compression.resolve(value) is expected


@pytest.mark.parametrize(("cls", "wire"), [(NoneCompressor, None), (FP16Compressor, torch.float16),
                                           (BF16Compressor, torch.bfloat16), (WireOnly, torch.bfloat16)])
def test_resolve_instantiates_classes(cls: type, wire: torch.dtype | None) -> None:
    got = Compression.resolve(cls)
    assert type(got) is cls and got.wire_dtype == wire


def test_global_fp16_scale_follows_the_wire_dtype() -> None:
    # the allreduce scales fp16 wires globally (overflow safety), whatever the class is called
    assert Compression.fp16.needs_global_scale and not Compression.bf16.needs_global_scale
    assert not Compression.none.needs_global_scale

    class MyHalf(Compressor):
        name = "half"
        wire_dtype = torch.float16

    assert Compression.resolve(MyHalf).needs_global_scale


ERROR_FEEDBACK = [
    ("int8", "keeps error-feedback state per parameter"),
    ("powersgd:2", "keeps error-feedback state per parameter"),
]
"""Accepted by the gradient reducer's front ends only (DistributedOptimizer, HorovodStrategy)."""


@pytest.mark.parametrize(("value", "needle"), REJECTED + ERROR_FEEDBACK)
def test_resolve_rejects_with_the_value_and_a_hint(value: Any, needle: str) -> None:
    with pytest.raises(CompressionError, match="HINT") as info:
        Compression.resolve(value)
    assert needle in str(info.value)
    assert isinstance(info.value, ValueError)


def test_resolve_hint_lists_what_this_caller_accepts() -> None:
    # a plain allreduce: the cast spellings only (int8 would be refused next)
    with pytest.raises(CompressionError) as info:
        Compression.resolve("int4")
    assert str(info.value) == ("compression='int4' is not a compressor. HINT: use one of 'none', 'fp16' or "
                               "'bf16', or a Compressor such as hvd_trainer.Compression.fp16.")
    # a gradient reducer without "auto" (LocalSGD's outer step, the fusion reducer)
    with pytest.raises(CompressionError) as info:
        Compression.resolve("int4", allow_error_feedback=True)
    assert ("HINT: use one of 'none', 'fp16', 'bf16', 'int8', 'powersgd' or 'powersgd:R' (R >= 1, "
            "e.g. 'powersgd:4'), or a Compressor") in str(info.value)
    assert "'auto'" not in str(info.value)


def test_spellings_are_one_list() -> None:
    assert compression_spellings() == ("none", "fp16", "bf16")
    assert compression_spellings(allow_error_feedback=True, allow_auto=True) == (
        "none", "fp16", "bf16", "int8", "powersgd", "powersgd:R", "auto")
    from hvd_trainer.comm.reduce.auto import AUTO

    assert AUTO == "auto"  # the front ends' check and the listed spelling are one constant


def test_resolve_raises_the_callers_error_class() -> None:
    class FrontEndError(ValueError):
        pass

    with pytest.raises(FrontEndError, match="compression='zip'"):
        Compression.resolve("zip", error=FrontEndError)


# -- front ends: the Lightning strategy ----------------------------------------------------------
@pytest.mark.parametrize(("value", "expected"), ACCEPTED)
def test_strategy_accepts_every_form(value: Any, expected: Compressor) -> None:
    from hvd_trainer.strategy import HorovodStrategy

    assert HorovodStrategy(compression=value).compression is expected
    assert type(HorovodStrategy(compression=FP16Compressor).compression) is FP16Compressor


@pytest.mark.parametrize(("value", "needle"), REJECTED)
def test_strategy_rejects_every_bad_form(value: Any, needle: str) -> None:
    from hvd_trainer.strategy import HorovodStrategy, StrategyConfigError

    with pytest.raises(StrategyConfigError, match="HINT") as info:
        HorovodStrategy(compression=value)
    assert needle in str(info.value)


GRADIENT_SPELLINGS = compression_spellings(allow_error_feedback=True, allow_auto=True)
"""What the strategy and both DistributedOptimizers accept: each is accepted and each is listed."""
INT4_HINT = ("compression='int4' is not a compressor. HINT: use one of 'none', 'fp16', 'bf16', 'int8', "
             "'powersgd', 'powersgd:R' (R >= 1, e.g. 'powersgd:4') or 'auto', or a Compressor such as "
             "hvd_trainer.Compression.fp16.")


@pytest.mark.parametrize("spelling", GRADIENT_SPELLINGS)
def test_strategy_accepts_every_listed_spelling(spelling: str) -> None:
    from hvd_trainer.strategy import HorovodStrategy

    HorovodStrategy(compression=spelling.replace(":R", ":4"))


def test_strategy_hint_lists_every_spelling() -> None:
    from hvd_trainer.strategy import HorovodStrategy, StrategyConfigError

    with pytest.raises(StrategyConfigError) as info:
        HorovodStrategy(compression="int4")
    assert str(info.value) == INT4_HINT


# -- front ends: the torch DistributedOptimizer ----------------------------------------------------
def _world_of_one() -> World:
    return World(rank=0, size=1, local_rank=0, local_size=1, cross_rank=0, cross_size=1,
                 device=torch.device("cpu"), backend="gloo")


def _torch_opt(**kwargs: Any):
    import hvd_trainer as hvd

    model = torch.nn.Linear(2, 1)
    return hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    model.named_parameters(), world=_world_of_one(), **kwargs)


@pytest.mark.parametrize(("value", "expected"), ACCEPTED)
def test_torch_optimizer_accepts_every_form(value: Any, expected: Compressor) -> None:
    # "fp16" used to be stored as a string and fail at the first synchronize()
    assert _torch_opt(compression=value).compression is expected
    assert type(_torch_opt(compression=BF16Compressor).compression) is BF16Compressor


@pytest.mark.parametrize(("value", "needle"), REJECTED)
def test_torch_optimizer_rejects_every_bad_form_at_construction(value: Any, needle: str) -> None:
    from hvd_trainer.torch.optimizer import OptimizerConfigError

    with pytest.raises(OptimizerConfigError, match="HINT") as info:
        _torch_opt(compression=value)
    assert needle in str(info.value)


@pytest.mark.parametrize("spelling", GRADIENT_SPELLINGS)
def test_torch_optimizer_accepts_every_listed_spelling(spelling: str) -> None:
    _torch_opt(compression=spelling.replace(":R", ":4"))


def test_torch_optimizer_hint_lists_every_spelling() -> None:
    from hvd_trainer.torch.optimizer import OptimizerConfigError

    with pytest.raises(OptimizerConfigError) as info:
        _torch_opt(compression="int4")
    assert str(info.value) == INT4_HINT


def test_comm_allreduce_resolves_compression_like_every_front_end() -> None:
    # The allreduce path itself takes the same forms (a world of one needs no launcher).
    was_initialized = comm.is_initialized()
    comm.init()
    try:
        t = torch.tensor([1.5, -2.0])
        for form in ("fp16", comm.Compression.fp16, type(comm.Compression.bf16)):
            assert torch.equal(comm.allreduce(t, compression=form), t)
        assert torch.equal(comm.grouped_allreduce([t], compression="bf16")[0], t)

        class OwnCast(comm.Compressor):
            def compress(self, tensor):  # type: ignore[override]
                return tensor, None

        with pytest.raises(comm.CommTypeError, match="compress"):
            comm.allreduce(t, compression=OwnCast())
        with pytest.raises(comm.CommTypeError, match="int8"):
            comm.allreduce(t, compression="int8")
    finally:
        if not was_initialized:
            comm.shutdown()


def test_powersgd_default_rank_is_the_one_the_sweep_chose() -> None:
    """``Compression.powersgd()``, the string ``"powersgd"`` and auto's PowerSGD share one default
    rank (16: the README's rank sweep on the GPT recipe; rank 1 reached val_loss 2.45 there)."""
    assert DEFAULT_POWERSGD_RANK == 16
    assert Compression.powersgd().rank == DEFAULT_POWERSGD_RANK
    assert Compression.resolve("powersgd", allow_error_feedback=True).name == "powersgd(rank=16)"
    slow = decide(LinkEstimate(bytes_per_s=2.5e6, latency_s=0.0), 2**22, local_steps=False, compute_s=0.01)
    assert slow.compression.name == "powersgd(rank=16)"


def test_powersgd_warms_up_by_default_everywhere_and_refuses_a_bad_count() -> None:
    """Every way to get PowerSGD (the factory, the strings, auto's choice) starts after the same
    synchronous warm-up (the README's 3-seed runs: 1.010 of sync with it, 1.039 without)."""
    assert DEFAULT_POWERSGD_WARMUP_STEPS == 128
    slow = decide(LinkEstimate(bytes_per_s=2.5e6, latency_s=0.0), 2**22, local_steps=False, compute_s=0.01)
    for comp in (Compression.powersgd(), Compression.resolve("powersgd:4", allow_error_feedback=True),
                 slow.compression):
        assert comp.sync_warmup_steps == DEFAULT_POWERSGD_WARMUP_STEPS
    assert Compression.powersgd(sync_warmup_steps=0).sync_warmup_steps == 0
    assert Compression.powersgd(sync_warmup_steps=0) != Compression.powersgd()
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(CompressionError, match="sync_warmup_steps=.* must be an int >= 0"):
            Compression.powersgd(sync_warmup_steps=bad)


def test_a_feedback_state_saved_before_the_warm_up_count_resumes_past_the_warm_up() -> None:
    """A PowerSGD state from before the count existed (no ``"reductions"``) was past any warm-up;
    it stays so through the state-dict round trips the front ends make (rename, merge)."""
    old = {"compressor": "powersgd(rank=2)", "residuals": {"w": torch.ones(2)}, "q": {}}
    state = FeedbackState("powersgd(rank=2)")
    state.load_state_dict(old)
    assert state.reduced("w") >= 2**40
    for saved in (rename_feedback(state.state_dict(), lambda k: k), merge_feedback([state.state_dict()])):
        again = FeedbackState("powersgd(rank=2)")
        again.load_state_dict(saved)
        assert again.reduced("w") == state.reduced("w") and again.reduced("new") == state.reduced("new")
    fresh = FeedbackState("powersgd(rank=2)")
    assert fresh.reduced("w") == 0 and fresh.empty
    fresh.reductions["w"] = 3
    kept = FeedbackState("powersgd(rank=2)")
    kept.load_state_dict(rename_feedback(fresh.state_dict(), lambda k: None if k == "x" else k))
    assert kept.reduced("w") == 3 and kept.reduced("other") == 0 and not kept.empty
