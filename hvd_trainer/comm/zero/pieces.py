"""Parameters cut between ranks (ZeRO by elements): their pieces, and the optimizer seen through
them.

With a plan made with ``split=True`` (:func:`~hvd_trainer.comm.zero.plan.plan_shards`; ZeRO
chooses it for an optimizer :func:`per_element` accepts, in stages 1 and 2, cutting contiguous
parameters only) a
parameter may be cut into contiguous pieces owned by different ranks. A piece is a 1-D view of
the parameter's storage (``param.detach().view(-1)[start:start + numel]``): the optimizer steps
the piece in place, which updates the parameter, and keeps state (``exp_avg``, ``momentum_buffer``,
...) of the piece's size only. This is exact for an optimizer whose update of an element reads
only that element's gradient and state (:data:`PER_ELEMENT`).

The user's optimizer keeps the parameters themselves in its ``param_groups``, so ``zero_grad``,
``GradScaler.unscale_``, clipping and LR schedulers see what they would without ZeRO; in stage 1
the pieces replace their parameter in ``param_groups`` only while the step runs
(:meth:`Pieces.stepping`, their gradients sliced from the parameter's). In stage 2 a rank holds
only its pieces' averaged gradients (the parameter's ``.grad`` is ``None``), so from the end of
the reduction until the step (:meth:`Pieces.hold`) the pieces it owns stand in ``param_groups``
for their parameter, with those gradients: ``GradScaler.unscale_`` and ``zero_grad`` reach them.
The optimizer state of a piece is keyed by the piece; the state dict maps it back to its
parameter (:meth:`Pieces.set_aside`, :func:`join_states`, :meth:`Pieces.split_loaded`), so a
consolidated state loads into the plain torch optimizer and a full state loads at any world size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from hvd_trainer.comm.base.errors import CommValueError

__all__ = ["PER_ELEMENT", "Pieces", "per_element", "join_states", "ZeroLayoutError"]

PER_ELEMENT = ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Rprop", "Adadelta",
               "ASGD", "Adagrad")
"""``torch.optim`` classes whose update of each element reads only that element's gradient and
state (scalars such as ``step`` aside): their parameters may be cut by elements (Adagrad's state,
made in its constructor, is cut with them: :meth:`Pieces.split_loaded`). Not here: Adafactor and
Muon (state and update per matrix), any optimizer from outside ``torch.optim``."""


def per_element(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is a ``torch.optim`` class in :data:`PER_ELEMENT`."""
    cls = type(optimizer)
    return cls.__module__.startswith("torch.optim") and cls.__name__ in PER_ELEMENT


class ZeroLayoutError(CommValueError):
    """A parameter cut between ranks is no longer contiguous (its memory layout changed after
    the optimizer was wrapped), so its pieces cannot be views of it."""


def _is_per_element(value: Any, numel: int) -> bool:
    """A state tensor with one value per element of a 1-D piece of ``numel`` elements."""
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == numel


class Pieces:
    """The pieces of the parameters a plan cut between ranks, and the ones this rank owns.

    Args:
        entries: ``(parameter, start, numel, owner)`` of every piece of every cut parameter (any
            order; whole parameters are not listed).
        rank: this rank (in the plan's numbering).

    Raises:
        ZeroLayoutError: from :meth:`stepping`, :meth:`hold`, :meth:`set_aside` and
            :meth:`split_loaded`, when a cut parameter is no longer contiguous.
    """

    def __init__(self, entries: Iterable[tuple[torch.Tensor, int, int, int]], rank: int) -> None:
        self._params: dict[int, torch.Tensor] = {}
        self._cuts: dict[int, list[tuple[int, int, int]]] = {}  # id(param) -> [(start, numel, owner)]
        for p, start, numel, owner in entries:
            self._params[id(p)] = p
            self._cuts.setdefault(id(p), []).append((start, numel, owner))
        for cuts in self._cuts.values():
            cuts.sort()
        self.rank = rank
        self._views: dict[tuple[int, int], torch.Tensor] = {}
        self._ptr: dict[int, int] = {}
        self._grads: dict[tuple[int, int], torch.Tensor] = {}  # stage 2: reduced, until the step
        self._saved: list[list[torch.Tensor]] | None = None  # param_groups' lists while held
        self._refresh(None)

    def __bool__(self) -> bool:
        return bool(self._cuts)

    # -- the views ---------------------------------------------------------------------------
    def _refresh(self, optimizer: torch.optim.Optimizer | None) -> None:
        """(Re)make the views of any parameter whose storage moved (``model.to(...)``, ``p.data
        = ...``), moving the optimizer state of the old views to the new ones."""
        for pid, p in self._params.items():
            if self._ptr.get(pid) == p.data_ptr():
                continue
            if not p.is_contiguous():
                raise ZeroLayoutError(
                    f"a parameter of shape {tuple(p.shape)} that ZeRO cut between ranks is no "
                    "longer contiguous (e.g. model.to(memory_format=torch.channels_last) after "
                    "the optimizer was wrapped); its pieces are views of its elements in order. "
                    "HINT: change the model's memory format before wrapping the optimizer.")
            flat = p.detach().view(-1)
            for start, numel, _ in self._cuts[pid]:
                new = flat[start : start + numel]
                old = self._views.get((pid, start))
                if old is not None and optimizer is not None and old in optimizer.state:
                    optimizer.state[new] = optimizer.state.pop(old)
                self._views[(pid, start)] = new
            self._ptr[pid] = p.data_ptr()

    def is_cut(self, p: torch.Tensor) -> bool:
        """Whether ``p`` is a parameter cut between ranks."""
        return id(p) in self._cuts

    def view(self, p: torch.Tensor, start: int) -> torch.Tensor:
        """The piece of ``p`` starting at element ``start`` (as of the last step or state-dict
        call, which remake the views of a parameter whose storage moved)."""
        return self._views[(id(p), start)]

    def of(self, p: torch.Tensor) -> list[torch.Tensor]:
        """Every piece of ``p`` (``[p]`` for a parameter not cut), in element order."""
        cuts = self._cuts.get(id(p))
        return [p] if cuts is None else [self.view(p, start) for start, _, _ in cuts]

    def owned_of(self, p: torch.Tensor) -> list[tuple[torch.Tensor, int, int]]:
        """``(view, start, numel)`` of each piece of ``p`` this rank owns (``p`` must be cut)."""
        return [(self.view(p, s), s, n) for s, n, o in self._cuts[id(p)] if o == self.rank]

    def owned_ids(self) -> set[int]:
        """``id`` of every piece this rank owns (they change when a parameter's storage moves)."""
        return {id(v) for p in self._params.values() for v, _, _ in self.owned_of(p)}

    def owned_numel(self, p: torch.Tensor) -> int:
        """Elements of the cut parameter ``p`` this rank steps."""
        return sum(n for _, n, o in self._cuts[id(p)] if o == self.rank)

    def owned_grads(self) -> list[torch.Tensor]:
        """The reduced gradients of the pieces this rank owns, held since :meth:`hold`."""
        return list(self._grads.values())

    # -- the optimizer seen through the pieces -----------------------------------------------
    def _swap_in(self, optimizer: torch.optim.Optimizer, *, from_params: bool) -> None:
        """Replace each cut parameter in ``param_groups`` by the pieces this rank owns, each
        with its gradient: held ones, or (``from_params``) sliced from the parameter's."""
        self._refresh(optimizer)
        self._saved = [group["params"] for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            params: list[torch.Tensor] = []
            for p in group["params"]:
                if id(p) not in self._cuts:
                    params.append(p)
                    continue
                grad = None if p.grad is None or not from_params else p.grad.detach()
                if grad is not None:  # a sparse gradient (nn.Embedding(sparse=True)): densified
                    grad = (grad.to_dense() if grad.is_sparse else grad).reshape(-1)
                for view, start, numel in self.owned_of(p):
                    view.grad = (grad[start : start + numel] if grad is not None
                                 else self._grads.get((id(p), start)))
                    params.append(view)
            group["params"] = params

    def release(self, optimizer: torch.optim.Optimizer) -> None:
        """Put the parameters back in ``param_groups`` (no-op unless the pieces stand there);
        held gradients stay held for the step."""
        if self._saved is None:
            return
        for group, params in zip(optimizer.param_groups, self._saved, strict=True):
            group["params"] = params
        self._saved = None
        for p in self._params.values():
            for view, _, _ in self.owned_of(p):
                view.grad = None

    def drop(self, optimizer: torch.optim.Optimizer) -> None:
        """:meth:`release`, and forget the held gradients (``zero_grad``)."""
        self.release(optimizer)
        self._grads = {}

    def hold(self, optimizer: torch.optim.Optimizer, grads: dict[tuple[int, int], torch.Tensor]) -> None:
        """Stage 2, after the reduction: ``grads`` (``{(id(param), start): gradient}``) become
        the owned pieces' ``.grad``, and the pieces stand in ``param_groups`` for their
        parameters until :meth:`stepping` ends (or :meth:`release`)."""
        if not self._cuts:
            return
        self.release(optimizer)
        self._grads = dict(grads)
        self._swap_in(optimizer, from_params=False)

    @contextlib.contextmanager
    def stepping(self, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        """While inside: each cut parameter in ``optimizer.param_groups`` is replaced by the
        pieces this rank owns, each with ``.grad`` the held gradient (stage 2) or the matching
        part of the parameter's (stage 1; a view when the gradient is contiguous); on exit the
        parameters are back, the pieces' ``.grad`` ``None`` and nothing is held."""
        if not self._cuts:
            yield
            return
        if self._saved is None:
            self._swap_in(optimizer, from_params=not self._grads)
        try:
            yield
        finally:
            self.release(optimizer)
            self._grads = {}

    @contextlib.contextmanager
    def set_aside(self, optimizer: torch.optim.Optimizer
                  ) -> Iterator[dict[tuple[int, int], tuple[int, dict]]]:
        """While inside, the pieces' state is out of ``optimizer.state`` (so torch's own
        ``state_dict()`` works) and yielded as ``{(index, start): (numel, state)}``, ``index``
        the parameter's number in ``optimizer.state_dict()``; put back on exit."""
        self.release(optimizer)
        self._refresh(optimizer)
        order = [p for group in optimizer.param_groups for p in group["params"]]
        index = {id(p): k for k, p in enumerate(order)}
        aside: dict[tuple[int, int], tuple[int, dict]] = {}
        held: list[tuple[torch.Tensor, dict]] = []
        for pid, p in self._params.items():
            for view, start, numel in self.owned_of(p):
                state = optimizer.state.pop(view, None)
                if state is not None:
                    held.append((view, state))
                    if pid in index:
                        aside[(index[pid], start)] = (numel, state)
        try:
            yield aside
        finally:
            for view, state in held:
                optimizer.state[view] = state

    def split_loaded(self, optimizer: torch.optim.Optimizer) -> None:
        """After ``optimizer.load_state_dict(full)``, or over the state an optimizer made in its
        constructor (Adagrad): replace each cut parameter's full state by the state of the
        pieces this rank owns (per-element tensors sliced, scalars copied)."""
        self.release(optimizer)
        self._refresh(optimizer)
        for p in self._params.values():
            full = optimizer.state.pop(p, None)
            if not full:
                continue
            flat = {k: (v.detach().reshape(-1) if isinstance(v, torch.Tensor) and v.dim() > 0
                        and v.shape == p.shape else None) for k, v in full.items()}
            for view, start, numel in self.owned_of(p):
                optimizer.state[view] = {
                    k: (flat[k][start : start + numel].clone() if flat[k] is not None
                        else v.clone() if isinstance(v, torch.Tensor) else v)
                    for k, v in full.items()
                }


def join_states(pieces: dict[tuple[int, int], tuple[int, dict]],
                shapes: dict[int, torch.Size]) -> dict[int, dict]:
    """Each cut parameter's full optimizer state from its pieces' states.

    Args:
        pieces: ``{(index, start): (numel, state)}`` from every rank (see :meth:`Pieces.set_aside`).
        shapes: the shape of parameter ``index``.

    Returns:
        ``{index: state}``: a per-element tensor is the pieces' in element order, reshaped to the
        parameter's shape; any other value (``step``) is the first piece's. A parameter whose
        pieces do not cover it (one never stepped) is left out, as torch leaves out a parameter
        without state.
    """
    by_param: dict[int, list[tuple[int, int, dict]]] = {}
    for (index, start), (numel, state) in pieces.items():
        by_param.setdefault(index, []).append((start, numel, state))
    out: dict[int, dict] = {}
    for index, parts in by_param.items():
        parts.sort(key=lambda part: part[0])
        if sum(n for _, n, _ in parts) != shapes[index].numel():
            continue
        first = parts[0][2]
        joined: dict[str, Any] = {}
        for key, value in first.items():
            if all(_is_per_element(state.get(key), n) for _, n, state in parts):
                joined[key] = torch.cat([state[key] for _, _, state in parts]).view(shapes[index])
            else:
                joined[key] = value
        out[index] = joined
    return out
