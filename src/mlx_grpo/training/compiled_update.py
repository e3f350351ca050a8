"""The optimizer step as one compiled function (compile_update = true): AdamW on the float32 masters (or on
the model), the compute copy cast from them, in one graph.

Eager, an AdamW step over SmolLM2's 272 trained tensors is ~15 element-wise primitives per tensor (moments,
bias correction, weight decay, the update), plus a cast and a model update per tensor with masters: ~5,000
dispatches, each a kernel launch on a GPU. Compiled, as mlx-lm's trainer compiles its step (`state =
[model.state, optimizer.state, ...]` declared as the compiled function's inputs and outputs), MLX fuses each
tensor's element-wise chain into one kernel. The arithmetic is the eager step's; a fused kernel may contract
a multiply and an add where the eager ops round twice, so weights agree within float32 rounding (tests:
three updates, compiled vs eager).

The compiled function captures the state containers themselves (the model, the optimizer's state dict, the
masters' dict), which resume replaces: it is rebuilt whenever one of them is a new object.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from mlx_grpo.training.optimization import MasterWeights


class CompiledUpdate:
    """`step(grads)`: training.optimization.optimizer_step(optimizer, model, grads, masters) as one compiled graph."""

    def __init__(self, optimizer, model: nn.Module, masters: MasterWeights):
        self.optimizer, self.model, self.masters = optimizer, model, masters
        self._fn, self._owners = None, None
        self.traces = 0  # compilations (once per state containers and gradient shapes)

    def _build(self):
        optimizer, model, masters = self.optimizer, self.model, self.masters
        if masters.active:
            optimizer.init(tree_unflatten(list(masters.masters.items())))
        else:
            optimizer.init(model.trainable_parameters())
        state = [model.state, optimizer.state] + ([masters.masters] if masters.active else [])

        def apply(grads):
            self.traces += 1
            if not masters.active:
                current = dict(tree_flatten(model.trainable_parameters()))
                optimizer.update(model, tree_unflatten([(k, g.astype(current[k].dtype))
                                                        for k, g in tree_flatten(grads)]))
                return
            flat = [(k, g.astype(mx.float32)) for k, g in tree_flatten(grads)]
            new = optimizer.apply_gradients(tree_unflatten(flat), tree_unflatten(list(masters.masters.items())))
            masters.masters.update(dict(tree_flatten(new)))  # in place: the compiled function holds this dict
            masters.sync(model)

        return mx.compile(apply, inputs=state, outputs=state)

    def step(self, grads) -> None:
        owners = (id(self.optimizer.state), id(self.masters.masters))
        if self._fn is None or owners != self._owners:
            self._fn, self._owners = self._build(), owners
        self._fn(grads)
