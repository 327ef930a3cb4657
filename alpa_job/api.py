"""The kit's public API for model authors: everything a model you bring needs, and nothing else.

A model is a *builder*: a function that takes the model's own settings and the compute dtype and
returns a `Model`. Train it with `python -m alpa_job train --model PACKAGE.MODULE:FUNCTION` (or an
entry point in the `alpa_job.models` group of an installed package: `--model NAME`), giving its
settings as `--model-arg KEY=VALUE` (repeatable) or a `model_args:` mapping in a `--config` file.

The builder declares its settings in one of two ways, and the kit reads their names, types and
defaults from that declaration (values are coerced to the declared type; an unknown name gets a
"did you mean"):

    @dataclasses.dataclass(frozen=True)
    class Args:
        num_layers: int = 2
        width: int = 128

    def build(args: Args, dtype) -> api.Model: ...           # the dataclass is the declaration

    def build(*, dtype, num_layers: int = 2, width: int = 128) -> api.Model: ...   # or keywords

A setting may be int, float, str or bool (or Optional of one); a dataclass field's
`metadata={"help": "...", "check": api.POSITIVE}` adds a help text and a bound the kit checks.

What a builder returns, `Model`:
- `module`: a flax module (anything with flax's `init` / `apply`), called on the batch field
  `input_field` (with `train=` when `batch_stats` is on);
- `loss(outputs, batch) -> [batch]`: the per-example loss (the kit averages it over the real rows of
  a fixed-shape batch, so a padded last batch trains like a short one); `mse` and `cross_entropy` are
  here;
- `batch_stats`: True for BatchNorm running statistics (the module takes `train: bool`);
- `synthetic(args, rng, n) -> {field: array of n rows}`: a learnable dataset for `--dataset
  synthetic` (numpy arrays; `rng` is a numpy Generator seeded from `--seed`);
- `decode(record: bytes) -> {field: array}`: one example of `--dataset array_record` (without it the
  kit's decoder reads records written by `alpa_job.data.records.write_records`);
- `dataset(args, path, split) -> grain.MapDataset`: your own input for `--dataset model` (`split` is
  "train" or "eval"; `path` is `--data-path` / `--eval-data-path`); each element is {field: array} for
  one row, and the kit shuffles, batches, shards and prefetches it like its own sources;
- `repeated_blocks(example_input) -> RepeatedBlocks`: for a model made of identical layers, so the
  kit initialises one block once instead of the whole model (the fast initialiser), and
  `--strategy pipeline` can cut the model between blocks (called one after the other, each on the
  previous one's output);
- `layer_count` / `layer_class`: the repeated layers and their flax class, for Alpa's pipelines and
  the JAX engine's (it takes over at the model's first call of `layer_class`);
- `depth_setting`: the name of the builder setting that counts those layers (e.g. "num_layers"), so
  `--strategy auto` can time its candidates on copies of the model with 1 and 3 layers and predict the
  whole model's step time and memory from them, compiling only the winner whole;
- `hf`: `HfWeights`, how the parameters are a Hugging Face checkpoint's tensors, for `--init-from hf:DIR`,
  `python -m alpa_job hf export` and `hf logits`.
- `causal_attention`: True for a decoder whose every attention is causal self-attention (since API 1.5).
  The report's MFU then counts FLOPs as MaxText does: causal attention's products at half (the masked upper
  triangle of the scores is no useful work), the full count beside it (`mfu_full`). The kit finds those
  products on the step's jaxpr: every product between two activations (a dot_general batched over batch
  and heads, as `jnp.einsum("bqhd,bkhd->bhqk", q, k)` is) that makes or reads a [.., seq, seq] score
  tensor, in the forward and the backward; cuDNN's fused attention (`jax.nn.dot_product_attention`)
  states its causal mask itself. Declare it only when those batched products are all causal attention
  (not, e.g., a mixture of experts' batched products). Without it the report counts every product whole
  and says so.

fp8 (`--precision fp8`): dense layers given `dot_general=api.dot_general` run their products in float8 while
the engine traces such a step (plain `lax.dot_general` otherwise); a model with none is refused in one line.

Token data (`--dataset tokens`): the kit cuts windows of `seq_len + 1` tokens into the field
`tokens` and checks the ids against `vocab_size`, both read from the builder's settings of those
names (GPT's convention: the model reads tokens[:, :-1] and predicts tokens[:, 1:]; `NextTokenInputs`
wraps a decoder so).

Sharding: parameters name *logical* axes with `logical(initializer, axes)`, using the names below;
the strategies' rules map them to the device mesh (`data` needs none; `fsdp` and `tensor` need every
parameter of 1 MiB or more with 2 or more dimensions to carry them, and keep smaller unnamed ones whole on
every device, with a note in the report). Activations may name theirs too, with `constrain(x, axes)` where a
layer's output leaves it (e.g. `constrain(x, (BATCH, SEQ, EMBED))` after each block): the engine pins
them to the strategy's layout there (rows over the data axis; under `tensor`, the MLP's and
attention's inner widths over the model axis), so XLA moves
parameters to the activations instead of resharding activations between layers. Without a
strategy engine around it (the Alpa engine, plain `apply`) `constrain` returns `x` unchanged.

`API_VERSION` is recorded in every run's report (`versions["alpa_job_api"]`). Importing this module
imports no jax: the kit reads a builder's declaration before it starts anything.
"""

from __future__ import annotations

import contextvars
import dataclasses
from typing import Any, Callable, Dict, Optional, Tuple

from alpa_job.setting import ABOVE_ZERO, NON_NEGATIVE, POSITIVE, Setting

API_VERSION = "1.5"

__all__ = [
    "API_VERSION",
    "Model",
    "RepeatedBlocks",
    "NextTokenInputs",
    "HfTensor",
    "HfWeights",
    "logical",
    "constrain",
    "dot_general",
    "mse",
    "cross_entropy",
    "Setting",
    "POSITIVE",
    "NON_NEGATIVE",
    "ABOVE_ZERO",
    "BATCH",
    "EMBED",
    "MLP",
    "HEADS",
    "KV",
    "VOCAB",
    "CHANNELS",
    "CONV_IN",
    "SEQ",
]

# Logical axis names: the only sharding vocabulary model code uses.
BATCH = "batch"
EMBED = "embed"  # model width (d_model / hidden_dim)
MLP = "mlp"  # feed-forward inner width
HEADS = "heads"
KV = "kv"  # per-head width
VOCAB = "vocab"
CHANNELS = "channels"  # conv output channels
CONV_IN = "conv_in"  # conv input channels
SEQ = "seq"


def logical(init: Callable, axes: Tuple[Optional[str], ...]) -> Callable:
    """Attach logical axis names (one per dimension, None for a dimension never split) to a
    parameter initializer. On a flax without logical partitioning (the Alpa image's may lack it) the
    initializer is returned unchanged: Alpa plans sharding itself."""
    import flax.linen as nn

    with_partitioning = getattr(nn, "with_logical_partitioning", None)
    return init if with_partitioning is None else with_partitioning(init, axes)


# Set by an engine while it traces a step: (activation, axes) -> the activation pinned to the
# strategy's layout. A context variable, so tracing on another thread (a concurrent compile) sees its own.
_ACTIVATION_LAYOUT: "contextvars.ContextVar[Optional[Callable[[Any, Tuple[Optional[str], ...]], Any]]]" = contextvars.ContextVar(
    "alpa_job_activation_layout", default=None
)


# Set by an engine while it traces a `--precision fp8` step: the matmul dot_general runs.
_MATMUL: "contextvars.ContextVar[Optional[Callable[..., Any]]]" = contextvars.ContextVar("alpa_job_matmul", default=None)


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    """jax.lax.dot_general, or the engine's fp8 product while it traces a `--precision fp8` step. Give it to
    your dense layers (`nn.Dense(..., dot_general=api.dot_general)`) so `--precision fp8` reaches them."""
    matmul = _MATMUL.get()
    if matmul is None:
        from jax import lax

        return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision, preferred_element_type=preferred_element_type)
    return matmul(lhs, rhs, dimension_numbers, precision=precision, preferred_element_type=preferred_element_type)


def constrain(x, axes: Tuple[Optional[str], ...]):
    """Name an activation's logical axes (one per dimension, None for one never split), so the
    engine's strategy can pin its layout there; unchanged outside an engine's step."""
    layout = _ACTIVATION_LAYOUT.get()
    return x if layout is None else layout(x, tuple(axes))


@dataclasses.dataclass(frozen=True)
class RepeatedBlocks:
    """A model's parameters as a shell plus identically shaped blocks, so the state's initialiser
    compiles one block once instead of every layer.

    `shell.init(rng, <the batch field>)["params"]` gives every parameter outside the blocks, named
    as in the whole model; `block.init(rng, <block_input>)["params"]` gives one block's; the whole
    model's parameters are the shell's plus one block under each of `names`.
    """

    shell: Any  # a flax module (or wrapper with .init) over the model's batch field
    block: Any  # the repeated flax module
    block_input: Any  # jax.ShapeDtypeStruct: what one block is called on
    names: Tuple[str, ...]  # the blocks' names in the whole model's params, in order


class NextTokenInputs:
    """The token convention's module wrapper: a row holds seq_len + 1 tokens (as `--dataset tokens` cuts them);
    the wrapped module reads tokens[:, :-1] and the loss predicts tokens[:, 1:] (`Model.module =
    NextTokenInputs(decoder)`; `.module` is the decoder)."""

    def __init__(self, module):
        self.module = module

    def init(self, rngs, tokens, **kwargs):
        return self.module.init(rngs, tokens[:, :-1], **kwargs)

    def apply(self, variables, tokens, **kwargs):
        return self.module.apply(variables, tokens[:, :-1], **kwargs)


@dataclasses.dataclass(frozen=True)
class HfTensor:
    """One parameter as one tensor of a Hugging Face checkpoint.

    `path`: the parameter's keys in the model's params (("layer_0", "attention", "query", "kernel"));
    `name`: the checkpoint's tensor ("model.layers.0.self_attn.q_proj.weight"); `shape`: its shape there;
    `transposed`: the parameter is the tensor transposed (PyTorch's Linear keeps [out, in], a flax kernel
    [in, out]) and then reshaped to the parameter's shape (heads split out of a projection's width)."""

    path: Tuple[str, ...]
    name: str
    shape: Tuple[int, ...]
    transposed: bool = False


@dataclasses.dataclass(frozen=True)
class HfWeights:
    """How a model's parameters are a Hugging Face checkpoint (config.json + *.safetensors), as the model's
    settings shape it.

    `architectures`: the config.json `architectures` this layout reads (the first is written on export);
    `config`: the config.json the settings imply (written on export); `settings`: its entries a checkpoint's
    config must agree with before it is read, each by its dotted path ("rope_scaling.factor") -> the builder
    setting that sets it (a mismatch's fix names it); `tensors`: one HfTensor per parameter."""

    architectures: Tuple[str, ...]
    config: Dict[str, Any]
    settings: Dict[str, str]
    tensors: Tuple[HfTensor, ...]


@dataclasses.dataclass(frozen=True)
class Model:
    """What a builder returns: the module and how the kit trains it (this module's docstring says
    what each field is for)."""

    module: Any
    input_field: str
    loss: Callable[[Any, Dict[str, Any]], Any]
    batch_stats: bool = False
    synthetic: Optional[Callable[[Any, Any, int], Dict[str, Any]]] = None
    decode: Optional[Callable[[bytes], Dict[str, Any]]] = None
    dataset: Optional[Callable[[Any, Optional[str], str], Any]] = None
    repeated_blocks: Optional[Callable[[Any], RepeatedBlocks]] = None
    layer_count: Optional[int] = None
    layer_class: Optional[type] = None
    depth_setting: Optional[str] = None
    hf: Optional[HfWeights] = None
    causal_attention: bool = False


def mse(outputs, batch):
    """Per-example mean squared error against batch["y"]."""
    return ((outputs - batch["y"]) ** 2).mean(axis=-1)


def cross_entropy(logits, labels):
    """Per-position cross entropy against integer labels, computed in float32 whatever the logits'
    dtype (a fused log-sum-exp: no float32 copy of the logits is kept for the backward pass)."""
    from alpa_job.losses import cross_entropy as fused

    return fused(logits, labels)
