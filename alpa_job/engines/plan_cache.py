"""`--plan-cache DIR`: keep an Alpa auto search's result and reuse it instead of searching again.

No `import alpa` here (tested without Alpa's CUDA jaxlib). Facts from alpa 0.2.3's source:

* `get_last_dp_result()` -> (profile file name, forward_stage_layer_ids, submesh_shapes,
  logical_mesh_shapes, autosharding_option_dicts). Element 0 is always None in 0.2.3
  (stage_construction imports the module global by value before it is set), so the profile file
  is found from the driver's stdout line `Profile result saved to: <file>` or, failing that, the
  newest `profile-results-*.npy` in the driver's cwd written since the search began.
* stage_profiling writes that file with `np.save(name, profile_results)` (a dict
  {stage key: StageProfileResult}) -- i.e. the .npy format, a 0-d object array -- but
  `AutoStageOption(cached_profile_result=path)` reads it with a raw `pickle.load(f)`, which
  cannot read .npy. So the cache stores `np.load(p, allow_pickle=True).item()` re-dumped with
  `pickle.dump`: the file `AutoStageOption` actually loads.
* Reuse: parts 1-4 become `ManualStageOption(forward_stage_layer_ids, submesh_physical_shapes,
  submesh_logical_shapes, submesh_autosharding_option_dicts)` (with the same AutoLayerOption):
  no profiling, no DP, no second-search NotImplementedError.

Layout: DIR/<key>/plan.json (the four parts + the key's inputs), DIR/<key>/profile.pkl.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import io
import json
import os
import pickle
import re
import sys
import time
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence

from alpa_job.errors import KitError
from alpa_job import strict_json

PLAN_FILE = "plan.json"
PROFILE_FILE = "profile.pkl"
PROFILE_LINE = re.compile(r"Profile result saved to:\s*(\S+)")
KEY_VERSIONS = ("alpa", "jax", "jaxlib", "flax", "optax", "ray", "cuda", "python")
MODEL_FIELDS = ("model", "model_args", "dtype")


def plan_key_inputs(
    config: Mapping[str, Any],
    batch_signature: Sequence,
    num_nodes: int,
    devices_per_node: int,
    device_kind: Optional[str],
    versions: Mapping[str, Any],
    method: Mapping[str, Any],
) -> Dict[str, Any]:
    """What the key hashes: model config, batch shapes, cluster shape, versions, method settings."""
    return {
        "model": {k: config.get(k) for k in MODEL_FIELDS},
        "batch": [[p, list(s), d] for p, s, d in batch_signature],
        "cluster": {"num_nodes": int(num_nodes), "devices_per_node": int(devices_per_node), "device_kind": device_kind},
        "versions": {k: versions.get(k) for k in KEY_VERSIONS},
        "method": dict(method),
    }


def plan_key(inputs: Mapping[str, Any]) -> str:
    text = json.dumps(inputs, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


# ----------------------------------------------------------------------------- profile file
def profile_file_from_log(text: str) -> Optional[str]:
    """The last `Profile result saved to: <file>` in the captured driver output."""
    found = PROFILE_LINE.findall(text or "")
    return found[-1] if found else None


def find_profile_file(log_text: str = "", cwd: str = ".", since: Optional[float] = None) -> Optional[str]:
    """Alpa's profile-results-*.npy of the last search: from the log line, else the newest in cwd."""
    named = profile_file_from_log(log_text)
    if named:
        path = named if os.path.isabs(named) else os.path.join(cwd, named)
        if os.path.isfile(path):
            return path
    cands = [
        p for p in glob.glob(os.path.join(glob.escape(cwd), "profile-results-*.npy")) if since is None or os.path.getmtime(p) >= since - 1
    ]
    return max(cands, key=os.path.getmtime) if cands else None


def convert_profile(npy_path: str, out_path: str) -> str:
    """np.save'd dict (.npy) -> a plain pickle, the format AutoStageOption's pickle.load reads."""
    import numpy as np

    try:
        loaded = np.load(npy_path, allow_pickle=True)
        value = loaded.item() if getattr(loaded, "shape", None) == () else loaded
    except (OSError, ValueError, pickle.UnpicklingError) as err:
        raise KitError(f"cannot read Alpa's profile result {npy_path} ({err}); delete it and search again") from None
    if not isinstance(value, dict):
        raise KitError(f"{npy_path} holds {type(value).__name__}, not Alpa's dict of stage profile results")
    tmp = out_path + ".tmp"
    with open(tmp, "wb") as f:
        pickle.dump(value, f)
    os.replace(tmp, out_path)
    return out_path


@contextlib.contextmanager
def tee_stdout() -> Iterator[io.StringIO]:
    """Capture what the driver prints (Alpa prints the profile file name) while still printing it."""
    buf = io.StringIO()
    real = sys.stdout

    class _Tee(io.TextIOBase):
        def write(self, s):  # type: ignore[override]
            buf.write(s)
            return real.write(s)

        def flush(self):
            real.flush()

    sys.stdout = _Tee()
    try:
        yield buf
    finally:
        sys.stdout = real


# ----------------------------------------------------------------------------- the cache
def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item") and callable(value.item) and getattr(value, "shape", None) == ():
        return value.item()  # numpy scalars
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "tolist"):
        return value.tolist()
    raise KitError(f"cannot store {type(value).__name__} {value!r} of Alpa's search result in the plan cache")


def dp_result_to_plan(dp_result: Sequence[Any]) -> Dict[str, Any]:
    """get_last_dp_result() parts 1-4 -> the plan.json fields (ManualStageOption's argument names)."""
    if dp_result is None or len(dp_result) != 5 or dp_result[1] is None:
        raise KitError(
            "Alpa reported no auto-search result (get_last_dp_result() is empty); the plan cache "
            "only stores results of --strategy pipeshard-auto"
        )
    _, layer_ids, submesh, logical, options = dp_result
    return {
        "forward_stage_layer_ids": _jsonable(layer_ids),
        "submesh_physical_shapes": _jsonable(submesh),
        "submesh_logical_shapes": _jsonable(logical),
        "submesh_autosharding_option_dicts": _jsonable(options),
    }


def manual_stage_kwargs(plan: Mapping[str, Any]) -> Dict[str, Any]:
    """ManualStageOption(**kwargs) from a stored plan: shapes back to tuples, as Alpa made them."""
    return {
        "forward_stage_layer_ids": [list(map(int, ids)) for ids in plan["forward_stage_layer_ids"]],
        "submesh_physical_shapes": [tuple(int(x) for x in s) for s in plan["submesh_physical_shapes"]],
        "submesh_logical_shapes": [tuple(int(x) for x in s) for s in plan["submesh_logical_shapes"]],
        "submesh_autosharding_option_dicts": [dict(d) for d in plan["submesh_autosharding_option_dicts"]],
    }


class PlanCache:
    def __init__(self, root: str):
        self.root = root

    def dir(self, key: str) -> str:
        return os.path.join(self.root, key)

    def lookup(self, key: str) -> Optional[Dict[str, Any]]:
        """The stored entry (plan.json contents + profile path) or None."""
        path = os.path.join(self.dir(key), PLAN_FILE)
        if not os.path.isfile(path):
            return None
        try:
            with open(path) as f:
                entry = json.load(f)
            manual_stage_kwargs(entry["plan"])  # validate
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise KitError(f"plan cache entry {path} is unreadable ({err}); delete {self.dir(key)} to search again")
        if entry.get("key") != key:
            raise KitError(f"plan cache entry {path} belongs to key {entry.get('key')}, not {key}; delete it")
        profile = os.path.join(self.dir(key), PROFILE_FILE)
        entry["profile_path"] = profile if os.path.isfile(profile) else None
        return entry

    def save(
        self,
        key: str,
        key_inputs: Mapping[str, Any],
        dp_result: Sequence[Any],
        profile_npy: Optional[str],
        extra: Optional[Mapping[str, Any]] = None,
    ) -> Dict[str, Any]:
        d = self.dir(key)
        try:
            os.makedirs(d, exist_ok=True)
        except OSError as err:
            raise KitError(f"--plan-cache {self.root}: cannot create {d} ({err.strerror}); use a writable folder")
        profile = None
        if profile_npy:
            profile = convert_profile(profile_npy, os.path.join(d, PROFILE_FILE))
        entry = {
            "key": key,
            "key_inputs": dict(key_inputs),
            "plan": dp_result_to_plan(dp_result),
            "profile_source": profile_npy,
            "saved": time.strftime("%Y-%m-%dT%H:%M:%S"),
            **dict(extra or {}),
        }
        tmp = os.path.join(d, PLAN_FILE + ".tmp")
        with open(tmp, "w") as f:
            strict_json.dump(entry, f, indent=2, sort_keys=True)
        os.replace(tmp, os.path.join(d, PLAN_FILE))
        entry["profile_path"] = profile
        return entry


def decision_line(key: str, decision: str, root: str) -> str:
    what = {
        "hit": "reusing the saved plan (ManualStageOption), no auto search",
        "miss": "no saved plan: running the auto search, then saving it",
        "saved": "saved the auto search's plan for the next run",
    }.get(decision, decision)
    return f"[alpa_job] plan cache {root}: key {key}: {decision} ({what})"


def load_profile_like_alpa(path: str) -> Any:
    """Exactly what AutoStageOption(cached_profile_result=path) does in stage_profiling.py."""
    with open(path, "rb") as f:
        return pickle.load(f)


def entries(root: str) -> List[str]:
    return sorted(os.path.basename(os.path.dirname(p)) for p in glob.glob(os.path.join(glob.escape(root), "*", PLAN_FILE)))
