"""The train state's initialiser for the JAX engine: compiled for the state's target shardings, so
the state is created on the devices already split, and by parts where the model allows it.

Why by parts: XLA gives every parameter its own random-number kernels, and none is shared between
leaves (each carries its own key derivation), so a whole-model initialiser's compile grows with the
layer count: for a deep GPT it took longer to compile than the train step itself and was the long
pole of a cold run's time to first step. A model made of identically shaped blocks
(alpa_job/models, `RepeatedBlocks`) instead compiles one block's initialiser once and calls it once
per block, plus the shell (everything outside the blocks) and the optimizer state: a few seconds in all.

The result has the whole model's tree, names, shapes, logical axes and shardings (the same as
the whole model's init); only the random streams differ:
block i draws from fold_in(PRNGKey(seed), i + 1) and the shell from fold_in(.., 0), instead of flax's
path-derived keys. Models without `repeated_blocks` (and any with BatchNorm statistics) are
initialised whole, as before.
"""

from __future__ import annotations

from typing import Any, Callable, Dict

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from alpa_job.models import ModelSpec

# make_state(params, batch_stats) -> the train state (optimizer state created, step 0)
MakeState = Callable[[Any, Any], Any]
_SCALAR = jax.ShapeDtypeStruct((), np.int32)  # a seed or a block's index, abstract


def _zeros(abstract) -> Any:
    return jnp.zeros(abstract.shape, abstract.dtype)


def _freeze_like(params: Dict[str, Any], like: Any) -> Any:
    """Flax before 0.7 returns FrozenDicts: keep the whole model's container type (tree equality)."""
    if type(like) is dict:
        return params
    from flax.core import freeze

    return freeze(params)


class StateInitializer:
    """Builds the train state: `abstract_boxed()` (shapes + logical axes, no FLOPs), then
    `lower(abstract_state)` and `compile()` (on any one thread), then `__call__(seed)`."""

    def __init__(self, model: ModelSpec, example: Dict[str, Any], make_state: MakeState):
        self.model, self.make_state = model, make_state
        self._example = example  # batch field -> ShapeDtypeStruct
        blocks = model.repeated_blocks and not model.has_batch_stats
        self.parts = model.repeated_blocks(example[model.input_key]) if blocks else None
        self._lowered: Dict[str, Any] = {}
        self._compiled: Dict[str, Any] = {}

    # ----- the pieces, as functions of the seed -------------------------------------------------
    # The key is made inside each compiled piece from an int32 seed: a key made outside would be an
    # eager computation, compiled on its own: one more compile that everything else waits behind.
    def _whole_boxed(self, seed):
        inputs = _zeros(self._example[self.model.input_key])
        kwargs = {"train": False} if self.model.has_batch_stats else {}
        variables = self.model.module.init(jax.random.PRNGKey(seed), inputs, **kwargs)
        return self.make_state(variables["params"], variables.get("batch_stats"))

    def _shell_params(self, seed):
        inputs = _zeros(self._example[self.model.input_key])
        return self.parts.shell.init(jax.random.fold_in(jax.random.PRNGKey(seed), 0), inputs)["params"]

    def _block_params(self, seed, index):
        x = _zeros(self.parts.block_input)
        return self.parts.block.init(jax.random.fold_in(jax.random.PRNGKey(seed), index + 1), x)["params"]

    def _assemble(self, shell, blocks):
        params = dict(shell)
        params.update(zip(self.parts.names, blocks))
        return _freeze_like(params, shell)

    # ----- abstract ------------------------------------------------------------------------------
    def abstract_boxed(self):
        """The state's shapes and dtypes with the models' logical-axis boxes, computed without FLOPs
        (tracing one block, not every layer, where the model has parts)."""
        if self.parts is None:
            return jax.eval_shape(self._whole_boxed, _SCALAR)
        shell = jax.eval_shape(self._shell_params, _SCALAR)
        block = jax.eval_shape(self._block_params, _SCALAR, _SCALAR)
        params = self._assemble(shell, [block] * len(self.parts.names))
        return jax.eval_shape(lambda p: self.make_state(p, None), params)

    def abstract_model_params(self):
        """The model's own parameters (shapes, dtypes, logical boxes) as its apply takes them, where
        make_state lays them out otherwise (a pipeline stacks the blocks: only models with parts)."""
        shell = jax.eval_shape(self._shell_params, _SCALAR)
        block = jax.eval_shape(self._block_params, _SCALAR, _SCALAR)
        return self._assemble(shell, [block] * len(self.parts.names))

    # ----- compiled ------------------------------------------------------------------------------
    def lower(self, abstract_state, model_params=None) -> None:
        """Trace and lower every piece for `abstract_state` (the state's ShapeDtypeStructs, with the
        shardings it must be created in). `model_params`: the pieces' parameters in the model's own
        layout with the shardings to make them in, where make_state lays them out otherwise."""
        state_sharding = jax.tree_util.tree_map(lambda leaf: leaf.sharding, abstract_state)
        if self.parts is None:
            whole = lambda seed: nn.meta.unbox(self._whole_boxed(seed))  # noqa: E731
            self._lowered["whole"] = jax.jit(whole, out_shardings=state_sharding).lower(_SCALAR)
            return
        made = abstract_state.params if model_params is None else model_params
        params_sharding = jax.tree_util.tree_map(lambda leaf: leaf.sharding, made)
        shell_sharding = _freeze_like({k: v for k, v in params_sharding.items() if k not in self.parts.names}, params_sharding)
        shell = lambda seed: nn.meta.unbox(self._shell_params(seed))  # noqa: E731
        block = lambda seed, i: nn.meta.unbox(self._block_params(seed, i))  # noqa: E731
        self._lowered["shell"] = jax.jit(shell, out_shardings=shell_sharding).lower(_SCALAR)
        # Every block has the same logical axes and shapes, hence the same shardings as the first.
        self._lowered["block"] = jax.jit(block, out_shardings=params_sharding[self.parts.names[0]]).lower(_SCALAR, _SCALAR)
        # The parameters arrive in the shardings the pieces made them in: the state then reuses
        # (donation) their buffers.
        # (Not where make_state lays the parameters out otherwise: no output has the pieces' shapes.)
        donate = (0,) if model_params is None else ()
        make = jax.jit(lambda p: self.make_state(p, None), out_shardings=state_sharding, donate_argnums=donate)
        self._lowered["state"] = make.lower(made)

    def from_params(self, params, abstract_state):
        """The state made from given parameters (the model's own layout; e.g. a Hugging Face checkpoint's
        weights) instead of random ones: the pieces' last step, or for a model initialised whole its own
        make_state, compiled now for `abstract_state`'s shardings."""
        made = self._compiled.get("state")
        if made is None:
            sharding = jax.tree_util.tree_map(lambda leaf: leaf.sharding, abstract_state)
            made = jax.jit(lambda p: self.make_state(p, None), out_shardings=sharding).lower(params).compile()
        return made(params)

    def compile(self) -> None:
        for name, lowered in self._lowered.items():
            self._compiled[name] = lowered.compile()

    def __call__(self, seed: int):
        seed = np.int32(seed)
        if self.parts is None:
            return self._compiled["whole"](seed)
        shell = self._compiled["shell"](seed)
        blocks = [self._compiled["block"](seed, np.int32(i)) for i in range(len(self.parts.names))]
        return self._compiled["state"](self._assemble(shell, blocks))
