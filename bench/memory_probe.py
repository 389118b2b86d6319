"""What one training step of a rank really holds: saved activations (checkpointed modules
included), parameters, gradients and AdamW state, measured on the step itself.

`common.SavedTensors` sees what autograd saves through `saved_tensors_hooks`. Inside a
region of torch's non-reentrant `checkpoint` those hooks are replaced by checkpoint's own,
so two things a checkpointed module costs are invisible to them and are measured here,
with a third that no autograd node saves:
- its inputs, which the checkpoint keeps (in its recompute closure) until the module's
  backward: counted as saved from the module's call until the gradient reaches its output;
- the activations its recomputed forward holds during that backward: the module's own
  forward, run once more under the hooks on the same inputs the first time it is called
  in the step (the most any recomputed module of the rank saves counts once);
- a stage's output, which the runner holds from the forward until the backward (the next
  stage, on another rank, saves its copy): counted until the gradient reaches it; the last
  stage's output is its loss.
"""

from __future__ import annotations

import torch
from torch import nn

from bench.common import SavedTensors


class StepSaved(SavedTensors):
    """`SavedTensors` over one rank's `Stage` that also counts the inputs of its checkpointed
    modules and its stages' outputs, and measures the largest recomputed forward (`recompute`,
    bytes). `close()` puts the forwards it wraps back."""

    def __init__(self, stage):
        super().__init__(stage.module)
        self.recompute = 0
        self._measured: set[int] = set()
        self._wrapped = [(m, m.forward) for m in map(stage.model.get_submodule, stage.recomputed)]
        for m, forward in self._wrapped:
            m.forward = self._tracked(m, forward)
        self._stage, self._fns = stage, dict(stage.forward_fns)
        last = stage.resolved.num_stages - 1
        for s, fn in self._fns.items():
            if s != last:
                stage.forward_fns[s] = self._held(fn)

    def _pack(self, tensor: torch.Tensor):
        if _is_parameter(tensor):
            return tensor
        return super()._pack(tensor)

    def close(self) -> None:
        """Put the modules' and the stage's forwards back."""
        for m, forward in self._wrapped:
            m.forward = forward
        self._stage.forward_fns.update(self._fns)

    def _until_backward(self, out, kept: list) -> None:
        """Let the saved `kept` go when the gradient of `out` is computed."""
        first = out[0] if isinstance(out, tuple) else out
        if torch.is_tensor(first) and first.requires_grad:
            first.register_hook(lambda grad: kept.clear())  # the backward has reached it
        else:
            kept.clear()

    def _held(self, fn):
        def run(*args, **kwargs):
            out = fn(*args, **kwargs)
            self._until_backward(out, [self._pack(out)] if torch.is_tensor(out) else [])
            return out

        return run

    def _tracked(self, module: nn.Module, forward):
        def run(*args, **kwargs):
            tensors = [t for t in (*args, *kwargs.values()) if torch.is_tensor(t) and t.requires_grad]
            if id(module) not in self._measured and torch.is_grad_enabled():
                self._measured.add(id(module))
                self.recompute = max(self.recompute, self._forward_saved(module, forward, args, kwargs))
            kept = [self._pack(t) for t in tensors]  # the checkpoint's inputs, alive until its backward
            out = forward(*args, **kwargs)
            self._until_backward(out, kept)
            return out

        return run

    def _forward_saved(self, module, forward, args, kwargs) -> int:
        """Bytes the module's plain (not checkpointed) forward saves on these inputs, beyond
        what is already counted as saved (its inputs, when it saves them as they are)."""
        plain = getattr(forward, "__wrapped__", forward)
        seen, total = set(self.params) | set(self.refs), [0]

        def pack(tensor):
            if not _is_parameter(tensor):
                storage = getattr(tensor, "_local_tensor", tensor).untyped_storage()
                if storage.data_ptr() and storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total[0] += storage.nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = plain(*args, **kwargs)
        del out  # the probe's graph goes with it
        return total[0]


def _is_parameter(tensor: torch.Tensor) -> bool:
    # FSDP2 swaps its gathered parameters in during a unit's forward: not activations either.
    return isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter)


def local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t  # DTensor: this rank's shard
    return t.numel() * t.element_size()


def state_bytes(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Parameters, gradients and AdamW moments this rank holds, each tensor once."""
    params = list({id(p): p for p in module.parameters()}.values())
    return {
        "params": sum(local_bytes(p) for p in params),
        "grads": sum(local_bytes(p.grad) for p in params if p.grad is not None),
        "adamw": sum(local_bytes(v) for s in optimizer.state.values() for k, v in s.items()
                     if k in ("exp_avg", "exp_avg_sq")),
    }
