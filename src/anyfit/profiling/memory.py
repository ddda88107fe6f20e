"""Memory of a training step by kind, measured on the live run, and the planner's estimate beside it.

One step (the profiler's warm-up step, before the traced ones) is watched with PyTorch's own hooks:

- weights: the bytes of the model's parameters and buffers (this process's shards under FSDP);
- gradients: the bytes of every ``.grad`` when the optimizer step begins (``Optimizer.register_step_pre_hook``);
- optimizer state: the bytes of the optimizer's state tensors when the step ends (``register_step_post_hook``);
- activations and logits: what autograd saves for the backward pass, through
  ``torch.autograd.graph.saved_tensors_hooks``. Each saved tensor is counted once per storage while it is
  alive (a small holder object is handed to autograd; it is dropped when autograd frees the saved tensor after
  the backward), so the peak is the largest set kept at once, over every micro-batch of the window.
  Parameters are not activations (autograd saves weights for the input gradient); a saved tensor whose last
  dimension is the vocabulary is counted as logits. Layers under gradient checkpointing save through
  checkpointing's own hooks (innermost wins), so only what checkpointing keeps is seen, as it should be.

The planner's estimate (``anyfit.planning.memory.estimate_memory``) for the same setup is printed beside it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from anyfit.units import GIB


@contextlib.contextmanager
def saved_storages(model: torch.nn.Module):
    """Within the block, what autograd saves for the backward beyond ``model``'s parameters, as {storage: bytes}: each
    storage once (views share one), kept alive or not. What the planner's activation terms are checked against (its
    tests, ``benchmarks/expert_lora.py``); a run's own accounting is ``MemoryCensus``'s, which also sees them freed."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield kept


def _nbytes(t: torch.Tensor) -> int:
    local = getattr(t, "to_local", None)  # a DTensor under FSDP2: this process's shard
    t = local() if local is not None else t
    return t.numel() * t.element_size()


@dataclass
class MeasuredMemory:
    """Bytes per kind, measured on this process (``peak``: the device's peak counter, see hardware.memory)."""

    weights: int = 0
    gradients: int = 0
    optimizer: int = 0
    activations: int = 0
    logits: int = 0
    peak: int = 0

    def as_dict(self) -> dict[str, float]:
        return {k: round(v / GIB, 6) for k, v in self.__dict__.items()}


@dataclass
class _Saved:
    """The tensor autograd keeps; counted while this holder lives."""

    tensor: torch.Tensor
    census: "MemoryCensus"
    key: int

    def __del__(self):
        self.census._release(self.key)


@dataclass
class MemoryCensus:
    """Watches one step: ``watch()`` installs the hooks, ``close()`` removes them (see the module docstring)."""

    model: torch.nn.Module
    optimizer: object
    vocab_size: int
    measured: MeasuredMemory = field(default_factory=MeasuredMemory)
    _live: dict[int, list] = field(default_factory=dict)  # storage pointer -> [holders, bytes, kind]
    _now: dict[str, int] = field(default_factory=lambda: {"activations": 0, "logits": 0})
    _exit: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    def watch(self) -> None:
        params = {p.data_ptr() for p in self.model.parameters()}
        self.measured.weights = sum(_nbytes(t) for t in [*self.model.parameters(), *self.model.buffers()])
        inner = getattr(self.optimizer, "optimizer", self.optimizer)  # Accelerate's wrapper holds the torch one

        def pack(t: torch.Tensor):
            if t.data_ptr() in params or not t.is_floating_point():
                return t
            key = t.untyped_storage().data_ptr()
            if key in self._live:
                self._live[key][0] += 1
            else:
                kind = "logits" if t.dim() and t.shape[-1] == self.vocab_size else "activations"
                self._live[key] = [1, t.untyped_storage().nbytes(), kind]
                self._now[kind] += self._live[key][1]
                total = self._now["activations"] + self._now["logits"]
                if total > self.measured.activations + self.measured.logits:
                    self.measured.activations, self.measured.logits = self._now["activations"], self._now["logits"]
            return _Saved(t, self, key)

        def unpack(saved):
            return saved.tensor if isinstance(saved, _Saved) else saved

        self._exit.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, unpack))
        self._exit.callback(inner.register_step_pre_hook(self._gradients).remove)
        self._exit.callback(inner.register_step_post_hook(self._states).remove)

    def _release(self, key: int) -> None:
        entry = self._live.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self._now[entry[2]] -= entry[1]
            del self._live[key]

    def _gradients(self, optimizer, args, kwargs) -> None:
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        self.measured.gradients = max(self.measured.gradients, sum(_nbytes(g) for g in grads))

    def _states(self, optimizer, args, kwargs) -> None:
        states = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        self.measured.optimizer = sum(_nbytes(t) for t in states)

    def close(self) -> MeasuredMemory:
        self._exit.close()
        return self.measured
