"""Pipeline stages for the JAX engine: a model's repeated blocks cut into S stages along the mesh's
`stage` axis, the batch into M micro-batches, run SPMD (one program on every device, shard_map over the
mesh, activations handed to the next stage by collective permutes). Two schedules:

- GPipe (`--pipeline-repeats 1`): stage s holds one contiguous run of L/S blocks; the bubble is
  (S - 1) / (M + S - 1) of the ticks.
- circular (`--pipeline-repeats R`, R > 1): the blocks cut into R x S chunks; stage s holds chunks s, s + S,
  s + 2S, ..., and each micro-batch goes round the ring of stages R times, the last stage handing it back to
  the first. A tick runs 1/R of GPipe's work, so the bubble shrinks to (S - 1) / (R x M + S - 1) at R times
  the permutes (each 1/R the compute to hide behind). Needs M >= S: a micro-batch back from the last stage
  waits in a buffer until stage 0 is free for it.

The state keeps the blocks stacked: every block parameter gains a leading `layers` dimension, split
over `stage`, so stage s holds blocks s*L/S .. (s+1)*L/S - 1 and their optimizer state, and nothing of a
block ever crosses between stages. Circular: the stacked blocks, still in the model's order, are shaped
(R, L/R) (`repeats`, `layers`) and split over `stage` on the second dimension, which gives stage s exactly
its chunks, and keeps a checkpoint's layout the same for any stage count; everything outside the blocks (the shell: embeddings, final norm,
head) is whole on every device. Under `pipeline-fsdp` a stage's devices split its state further, as fsdp
splits it (most leaves along one dimension of their own), and gather the parameters whole once a step;
the gather's gradient is a reduce-scatter, so each device updates only its share. Each step:

1. every device reads its own rows, as under `data`; the rows of one data-parallel slot are gathered
   along `stage` (token ids: small), so every stage of the slot holds the same rows;
2. the shell runs on every stage; at the model's first call of its layer class the pipeline takes over:
   stage 0 feeds micro-batch t at tick t, each stage runs its blocks and permutes its output to the
   next, for M + S - 1 ticks (the S - 1 extra ticks are the bubble); later calls of the layer class
   return their input (their blocks already ran);
3. the last stage's outputs are split among the stages (a reduce-scatter over `stage`: the other stages
   hold zeros), so each stage runs what follows the blocks (final norm, head, loss) on its own rows only,
   not the whole slot: an SPMD pipeline runs the shell on every stage, and the head of a large vocabulary
   costs about two blocks; autodiff runs the schedule backwards (the permutes reversed), and the gradients
   are summed over the data axis (blocks) or every device (shell), in the compute dtype: a bf16 run sends
   half the bytes, as XLA's own reduction of data's gradients does on GPUs.

The model must declare `repeated_blocks` (alpa_job.api.RepeatedBlocks), call its blocks one after the
other, each on the previous one's output, and treat rows independently after them (GPT's and LLaMA's
decoders do).
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from alpa_job.errors import KitError
from alpa_job.jax_compat import shard_map
from alpa_job.models import ModelSpec
from alpa_job.strategies import LAYERS, REPEATS, check_micro_batches

BLOCKS = "pipeline_blocks"  # the stacked blocks' key in the pipelined state's parameters
STAGE, DATA = "stage", "data"  # the pipeline strategy's mesh axes


def _is_spec(x) -> bool:
    return isinstance(x, PartitionSpec)


def _over_data(axis) -> bool:
    """Whether a PartitionSpec entry splits its dimension over a stage's devices."""
    return axis == DATA or (isinstance(axis, tuple) and DATA in axis)


def check_pipelinable(model: ModelSpec) -> None:
    """One line naming what to declare, for a model the pipeline cannot cut."""
    if model.repeated_blocks is None:
        raise KitError(
            f"--strategy pipeline cuts a model at its repeated blocks, and --model {model.name} declares "
            "none: set repeated_blocks (alpa_job.api.RepeatedBlocks) and layer_class in its api.Model, "
            "or use --strategy data / fsdp"
        )
    if model.has_batch_stats:
        raise KitError(
            f"--strategy pipeline cannot carry --model {model.name}'s BatchNorm statistics between "
            "micro-batches; use --strategy data / fsdp"
        )


class Pipeline:
    """One model's pipelined step on one mesh (axes stage x data)."""

    def __init__(self, model: ModelSpec, mesh, micro_batches: int, example: Dict[str, Any], repeats: int = 1, sum_dtype=None):
        self.model, self.mesh, self.sum_dtype = model, mesh, sum_dtype
        self.stages, self.data = mesh.shape[STAGE], mesh.shape[DATA]
        self.micro_batches, self.repeats = micro_batches, repeats
        check_pipelinable(model)
        parts = model.repeated_blocks(example[model.input_key])
        self.block, self.names = parts.block, tuple(parts.names)
        self.layer_class = model.layer_class or type(parts.block)
        layers, rows = len(self.names), example["mask"].shape[0]
        if layers % self.stages:
            fits = [s for s in range(2, layers + 1) if layers % s == 0]
            raise KitError(
                f"--pipeline-stages {self.stages} does not split --model {model.name}'s {layers} repeated "
                f"blocks evenly; use one of: {', '.join(map(str, fits)) or 'none (one block)'}"
            )
        if repeats > 1 and layers % (self.stages * repeats):
            fits = [r for r in range(2, layers // self.stages + 1) if layers % (self.stages * r) == 0]
            raise KitError(
                f"--pipeline-repeats {repeats} x {self.stages} stages does not split --model {model.name}'s "
                f"{layers} repeated blocks into equal chunks; use one of: {', '.join(map(str, fits)) or '1'}"
            )
        if repeats > 1 and micro_batches < self.stages:
            raise KitError(
                f"--pipeline-repeats {repeats} (circular) needs at least a micro-batch a stage: "
                f"--micro-batches {micro_batches} < {self.stages} stages; use --micro-batches "
                f"{self.stages} or more, or --pipeline-repeats 1"
            )
        check_micro_batches(rows, (self.stages, self.data), micro_batches)
        self.param_specs = None  # the state's split of the parameters (place), before anything is traced

    # ----- the state's layout --------------------------------------------------------------------
    def stack(self, params):
        """The model's parameters with its blocks stacked under BLOCKS (logical axis `layers` first)."""
        params = dict(params)
        blocks = [params.pop(name) for name in self.names]

        repeats = self.repeats
        axes = (LAYERS,) if repeats == 1 else (REPEATS, LAYERS)

        def shaped(leaves):
            whole = jnp.stack(leaves)
            return whole if repeats == 1 else whole.reshape((repeats, whole.shape[0] // repeats) + whole.shape[1:])

        def stacked(*leaves):
            if isinstance(leaves[0], nn.Partitioned):  # the logical axes' boxes: `layers` joins the names
                return leaves[0].replace(value=shaped([leaf.value for leaf in leaves]), names=axes + tuple(leaves[0].names))
            return shaped(leaves)

        params[BLOCKS] = jax.tree_util.tree_map(stacked, *blocks, is_leaf=lambda x: isinstance(x, nn.Partitioned))
        return params

    def place(self, param_specs) -> None:
        """The parameters' PartitionSpecs in the state (the strategy's rules): the blocks' first dimension over
        the stages, and under pipeline-fsdp one dimension of most leaves over a stage's devices as well."""
        self.param_specs = param_specs

    def _gathered(self, params):
        """The parameters whole within a stage: each leaf split over its stage's devices gathered, once a
        step (autodiff turns the gather into a reduce-scatter of its gradient)."""

        def gather(spec, leaf):
            for dim, axis in enumerate(spec):
                if _over_data(axis):
                    leaf = lax.all_gather(leaf, DATA, axis=dim, tiled=True)
            return leaf

        return jax.tree_util.tree_map(gather, self.param_specs, params, is_leaf=_is_spec)

    def _reduced(self, grads):
        """Each gradient summed where its parameter is replicated: over a stage's devices unless the gather
        already reduce-scattered it, and over the stages for the shell, which every stage holds whole."""

        def reduce(key):
            def leaf(spec, grad):
                axes = (() if key == BLOCKS else (STAGE,)) + (() if any(map(_over_data, spec)) else (DATA,))
                if not axes or self.sum_dtype in (None, grad.dtype):
                    return lax.psum(grad, axes) if axes else grad
                return lax.psum(grad.astype(self.sum_dtype), axes).astype(grad.dtype)

            return leaf

        return {key: jax.tree_util.tree_map(reduce(key), self.param_specs[key], value, is_leaf=_is_spec) for key, value in grads.items()}

    # ----- the step --------------------------------------------------------------------------------
    def value_and_grad(self, params, batch) -> Tuple[Any, Any]:
        """(the batch's mean loss over its real rows, the gradients in the parameters' layout)."""
        specs = self.param_specs
        rows = jax.tree_util.tree_map(lambda _: PartitionSpec((STAGE, DATA)), batch)
        run = shard_map()(self._local_value_and_grad, mesh=self.mesh, in_specs=(specs, rows), out_specs=(PartitionSpec(), specs))
        return run(dict(params), batch)

    def eval_sums(self, params, batch) -> Tuple[Any, Any]:
        """(sum of the per-example loss over real rows, real rows), as ModelSpec.eval_sums."""
        rows = jax.tree_util.tree_map(lambda _: PartitionSpec((STAGE, DATA)), batch)
        run = shard_map()(
            self._local_eval_sums, mesh=self.mesh, in_specs=(self.param_specs, rows), out_specs=(PartitionSpec(), PartitionSpec())
        )
        return run(dict(params), batch)

    def _slot_rows(self, batch):
        """This device's rows and those of the other stages of its data-parallel slot."""
        return jax.tree_util.tree_map(lambda x: lax.all_gather(x, STAGE, axis=0, tiled=True), batch)

    def _local_value_and_grad(self, params, own):
        slot = self._slot_rows(own)
        real_rows = lax.psum(slot["mask"].sum(), DATA)  # the same on every stage

        def objective(p):
            return self._own_loss_sum(self._gathered(p), slot, own) / jnp.maximum(real_rows, 1.0)

        loss, grads = jax.value_and_grad(objective)(params)
        return lax.psum(loss, (STAGE, DATA)), self._reduced(grads)

    def _local_eval_sums(self, params, own):
        slot = self._slot_rows(own)
        return (lax.psum(self._own_loss_sum(self._gathered(params), slot, own), (STAGE, DATA)), lax.psum(slot["mask"].sum(), DATA))

    def _own_loss_sum(self, params, slot, own):
        """Sum of the per-example loss over this device's own real rows: the slot's rows run through the
        stages, and what follows the blocks runs on this stage's share of their outputs (its own rows)."""
        shell = {key: value for key, value in params.items() if key != BLOCKS}
        calls = {"blocks": 0, "inside": False}

        def intercept(next_fun, args, kwargs, context):
            if context.method_name != "__call__" or calls["inside"] or not isinstance(context.module, self.layer_class):
                return next_fun(*args, **kwargs)
            calls["blocks"] += 1
            if calls["blocks"] > 1:
                return args[0]  # this block already ran inside the pipeline
            calls["inside"] = True
            try:
                return self._own_share(self._run_stages(params[BLOCKS], args[0], args[1:], kwargs))
            finally:
                calls["inside"] = False

        with nn.intercept_methods(intercept):
            outputs, _ = self.model.apply_train({"params": shell}, slot)
        if calls["blocks"] != len(self.names):
            raise KitError(
                f"--model {self.model.name} called its layer class {calls['blocks']} time(s) in one forward, "
                f"and declares {len(self.names)} repeated blocks; a pipeline needs each block called "
                "once, in order"
            )
        return (self.model.loss(outputs, own).astype(jnp.float32) * own["mask"]).sum()

    def _own_share(self, outputs):
        """This stage's rows of the last stage's outputs (the slot's rows are the stages' own rows in stage
        order); the other stages' outputs are zeros, so a reduce-scatter over `stage` hands each its share."""
        shares = outputs.reshape((self.stages, outputs.shape[0] // self.stages) + outputs.shape[1:])
        return lax.psum_scatter(shares, STAGE, scatter_dimension=0, tiled=False)

    def _run_stages(self, blocks, x, rest, kwargs):
        """The schedule over the stage axis: the first block's input in, the last block's output out (on the
        last stage; zeros elsewhere)."""
        stages, micro, repeats = self.stages, self.micro_batches, self.repeats
        inputs = x.reshape((micro, x.shape[0] // micro) + x.shape[1:])
        stage = lax.axis_index(STAGE)
        last_repeat_starts = (repeats - 1) * micro  # the items (repeat x micro-batch) of the last time round

        def run_chunk(h, chunk):
            def one(h, layer_params):
                return self.block.apply({"params": layer_params}, h, *rest, **kwargs), None

            return lax.scan(one, h, chunk, unroll=True)[0]

        def first_stage_input(t, circling):
            """GPipe: micro-batch t. Circular: item t, a fresh micro-batch on the first time round and on later
            ones what the last stage handed back."""
            if repeats == 1:
                return lax.dynamic_index_in_dim(inputs, jnp.minimum(t, micro - 1), keepdims=False)
            m = jnp.clip(t, 0, repeats * micro - 1) % micro
            return jnp.where(
                t < micro, lax.dynamic_index_in_dim(inputs, m, keepdims=False), lax.dynamic_index_in_dim(circling, m, keepdims=False)
            )

        def my_chunk(t: int):
            """Circular: this stage's blocks for the item it runs at tick t (the chunk of that time round). The tick
            is a Python int, so each chunk is a static slice; a tick where the stages are on different time rounds
            (at most two: M >= S) selects between two. (A traced index would make every tick's gradient a
            dynamic update of all the stage's blocks: on GPUs that compiled for minutes.)"""
            round_of = [min(max(t - s, 0) // micro, repeats - 1) for s in range(stages)]
            low, high = min(round_of), max(round_of)
            later = stage < sum(r == high for r in round_of)  # the first stages are a round ahead
            return jax.tree_util.tree_map(lambda leaf: leaf[low] if low == high else jnp.where(later, leaf[high], leaf[low]), blocks)

        def tick(carry, t, chunk):
            handed, circling, outputs = carry
            if repeats > 1:  # stage 0 keeps what the last stage ran at t - 1 until it runs its next time round
                back = t - stages
                kept = lax.dynamic_update_index_in_dim(circling, handed, jnp.maximum(back, 0) % micro, 0)
                circling = jnp.where((stage == 0) & (back >= 0) & (back < last_repeat_starts), kept, circling)
            h = jnp.where(stage == 0, first_stage_input(t, circling), handed)
            out = run_chunk(h, chunk)
            done = t - (stages - 1) - last_repeat_starts  # the micro-batch the last stage finishes at tick t
            written = lax.dynamic_update_index_in_dim(outputs, out, jnp.maximum(done, 0), 0)
            outputs = jnp.where((stage == stages - 1) & (done >= 0), written, outputs)
            handed = lax.ppermute(out, STAGE, hand_offs)
            return (handed, circling, outputs), None

        # GPipe hands nothing from the last stage to the first (a permute pair costs its bytes, across hosts
        # the network's); the circular schedule hands each micro-batch back round the ring.
        hand_offs = [(s, (s + 1) % stages) for s in range(stages if repeats > 1 else stages - 1)]

        circling = jnp.zeros_like(inputs) if repeats > 1 else jnp.zeros((), inputs.dtype)
        carry = (jnp.zeros_like(inputs[0]), circling, jnp.zeros_like(inputs))
        # Both loops unrolled (one program of ticks x blocks, compiled longer): with XLA while loops around the
        # blocks and the permutes, a GPT 24L step on two H200s took 1.6x as long.
        if repeats == 1:
            carry, _ = lax.scan(lambda c, t: tick(c, t, blocks), carry, jnp.arange(self.ticks), unroll=True)
        else:
            for t in range(self.ticks):
                carry, _ = tick(carry, t, my_chunk(t))
        return carry[2].reshape(x.shape)

    @property
    def ticks(self) -> int:
        return self.repeats * self.micro_batches + self.stages - 1

    # ----- what the report says ----------------------------------------------------------------------
    def describe(self, processes_of_stage) -> Dict[str, Any]:
        """Stages, micro-batches, the bubble, and which blocks run where (a stage's JAX processes: one a host)."""
        per = len(self.names) // (self.stages * self.repeats)  # blocks a chunk; stage s holds chunks s + r x S

        def chunks_of(stage):
            return [list(self.names[c * per : (c + 1) * per]) for c in range(stage, len(self.names) // per, self.stages)]

        return {
            "stages": self.stages,
            "micro_batches": self.micro_batches,
            "repeats": self.repeats,
            "schedule": "gpipe" if self.repeats == 1 else "circular",
            "bubble_fraction": round((self.stages - 1) / self.ticks, 4),
            "layers": [
                {"stage": s, "blocks": sum(chunks_of(s), []), "chunks": chunks_of(s), "processes": processes_of_stage[s]}
                for s in range(self.stages)
            ],
        }
