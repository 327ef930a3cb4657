"""What differs between the jax versions the kit runs on, in one place (imported where jax is installed)."""

from __future__ import annotations

import functools


def shard_map():
    """jax.shard_map (jax >= 0.6) or its experimental predecessor (the Python 3.9 side's jax 0.4), with the
    replication check off (the kit's bodies psum what they must themselves)."""
    import jax

    if hasattr(jax, "shard_map"):
        return functools.partial(jax.shard_map, check_vma=False)
    from jax.experimental.shard_map import shard_map as experimental

    return functools.partial(experimental, check_rep=False)


def load_executable_parts(payload: bytes):
    """A serialised executable (jax.experimental.serialize_executable's bytes) deserialised and loaded onto the
    devices, without the argument and result trees deserialize_and_load wraps it in: the slow part, which can
    then run before the caller has built those trees. Relies on that module's private unpickler: a jax where it
    differs raises here, and the caller loads the public way."""
    import io

    import jax
    from jax.experimental import serialize_executable

    backend = jax.devices()[0].client
    unloaded, args_info_flat, no_kwargs = serialize_executable._JaxPjrtUnpickler(io.BytesIO(payload), backend).load()
    return unloaded.load(), args_info_flat, no_kwargs


def compiled_from_parts(parts, in_tree, out_tree):
    """load_executable_parts' result as deserialize_and_load returns it (a jax.stages.Compiled)."""
    import jax

    loaded, args_info_flat, no_kwargs = parts
    args_info = in_tree.unflatten(args_info_flat)
    try:
        return jax.stages.Compiled(loaded, [], args_info, out_tree, no_kwargs=no_kwargs)
    except TypeError:  # jax before executables kept their constants apart
        return jax.stages.Compiled(loaded, args_info, out_tree, no_kwargs=no_kwargs)


def serialize_compiled(compiled) -> bytes:
    """jax.experimental.serialize_executable.serialize's bytes, for a step that lowered a custom-partitioned op on
    several devices too (cuDNN's attention does): JAX keeps that op's partitioning callbacks alive with the
    executable for XLA's partitioner, which runs while compiling, and they cannot be pickled. The copy that is
    serialised leaves them out; the executable itself is not touched."""
    import copy
    import dataclasses

    from jax.experimental import serialize_executable

    executable = compiled._executable
    unloaded = getattr(executable, "_unloaded_executable", None)
    keepalive = getattr(unloaded, "keepalive", None) or ()
    kept = [k for k in keepalive if type(k).__name__ != "_ShardingCallbackInfo"]
    if len(kept) == len(keepalive):
        return serialize_executable.serialize(compiled)[0]
    executable_copy, compiled_copy = copy.copy(executable), copy.copy(compiled)
    executable_copy._unloaded_executable = dataclasses.replace(unloaded, keepalive=kept)
    compiled_copy._executable = executable_copy
    return serialize_executable.serialize(compiled_copy)[0]
