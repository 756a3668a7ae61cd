"""A loop that steps its weights itself after ``backward()``: its backward passes are its steps.

Some well-known examples update the weights by hand, no torch optimizer
(``for p in model.parameters(): p.data.add_(p.grad, alpha=-lr)``), so the optimizer hooks of
:mod:`.plain` never fire. This watches ``torch.autograd.backward`` (``loss.backward()`` calls it)
until an optimizer steps (then :mod:`.plain` has the loop, and this stands aside) or it finds a
loop that steps by hand:

1. the first backward pass names the model: the one root module that owns the leaves of the
   loss's graph (:func:`~syncclient.hooks.model.find_model`); the first values of those leaves are noted;
2. at the model's next forward, if no optimizer stepped and the values changed, the weights were
   stepped by hand: the loop joins the run there, before that forward (the first step, taken
   before the join, is counted; the join replaces it with the run's version but on the first peer);
   unchanged values (gradient accumulation before an optimizer step) keep it watching;
3. from then on each backward pass is a step of :class:`~syncclient.schedule.SyncClock`, and a sync
   that falls due is made at the model's next forward (the update after that backward is done by
   then), at a read of its state or a save of it, or at exit, as for an optimizer's loop.

Cost while watching or stepping by hand: one Python call per backward pass and one per module
call (a global forward pre-hook: a hook on the model would travel with ``torch.save(model)``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.nn.modules.module import register_module_forward_pre_hook

from syncclient.hooks import session, shard
from syncclient.hooks.model import AmbiguousModel, find_model

if TYPE_CHECKING:
    from syncclient.hooks.plain import PlainLoop

__all__ = ["ByHand"]


class ByHand:
    def __init__(self, loop: PlainLoop) -> None:
        self.loop = loop
        self.model: torch.nn.Module | None = None
        self.leaves: list[torch.Tensor] = []
        self.before: torch.Tensor | None = None  # the leaves' first values after the first backward
        self.stepping = False  # by hand, joined
        self._forward: Any = None
        self._original = torch.autograd.backward
        self._hook = self._backward  # one bound method: the one to find and remove
        torch.autograd.backward = self._hook

    def stop(self) -> None:
        """An optimizer stepped: :mod:`.plain` has the loop."""
        if torch.autograd.backward is self._hook:
            torch.autograd.backward = self._original
        if self._forward is not None:
            self._forward.remove()
            self._forward = None

    def _backward(self, tensors: Any, *args: Any, **kwargs: Any) -> Any:
        if self.model is None and session.owner() is None:
            self._name_the_model(tensors)
        result = self._original(tensors, *args, **kwargs)
        if self.stepping:
            client = self.loop.client
            client.progress(shard.take_samples() or 1)
            self.loop._due = self.loop._due or client.due
        elif self.model is not None and self.before is None:
            self.before = _first_values(self.leaves)
            self._forward = register_module_forward_pre_hook(self._at_forward)
        return result

    def _name_the_model(self, tensors: Any) -> None:
        leaves = _leaves(tensors)
        if leaves:
            try:
                self.model = find_model(leaves)
            except AmbiguousModel:
                return  # not a model's training (two models, loose tensors): an optimizer may still tell
            self.leaves = leaves

    def _at_forward(self, module: torch.nn.Module, args: Any) -> None:
        if module is not self.model:
            return
        if self.stepping:
            if self.loop._due:
                self.loop._sync()
            return
        if session.owner() is not None:  # a Trainer claimed the process meanwhile
            self.stop()
            return
        assert self.before is not None
        if torch.equal(self.before, _first_values(self.leaves)):
            return  # not stepped yet: gradients accumulate for an optimizer's step
        if not session.claim("torch", "a loop that steps its weights by hand"):
            self.stop()
            return
        self.stepping = True
        self.loop.stop()  # the optimizer hooks: this loop's steps are its backward passes
        self.loop._join(self.model, "backward passes")
        self.loop.client.progress(shard.take_samples() or 1)  # the first step, before the join
        self.loop._due = self.loop.client.due
        self.leaves, self.before = [], None
        if self.loop._due:
            self.loop._sync()


def _leaves(tensors: Any) -> list[torch.Tensor]:
    """The tensors a backward pass from ``tensors`` accumulates gradients into (the graph's leaves;
    not empty ones, which have no first value to watch)."""
    roots = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    stack: list[Any] = [t.grad_fn for t in roots if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen, leaves = set(), []
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)  # an AccumulateGrad node's leaf
        if variable is not None and variable.numel():
            leaves.append(variable)
        stack.extend(child for child, _ in node.next_functions)
    return leaves


def _first_values(leaves: list[torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return torch.stack([leaf.detach().reshape(-1)[0].float() for leaf in leaves]).cpu()
