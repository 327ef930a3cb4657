"""The --plan-cache round trip (alpa_job/engines/plan_cache.py), GPU-free.

The real-Alpa test runs in .venv39: alpa 0.2.3's own `ModuleProfileResult` / `StageProfileResult`
(stage_profiling.py) and `ManualStageOption` (stage_construction.py) are compiled from the
installed package's source (those modules cannot be imported without Alpa's jaxlib) under their
real module names; the profile dict is written exactly as Alpa writes it (`np.save` of
{(start, end, mesh_id, config_idx): StageProfileResult} as profile-results-<timestamp>.npy, and
the `Profile result saved to:` line printed), found, converted, and read back with the exact
`pickle.load` that AutoStageOption(cached_profile_result=...) performs.
"""

import json
import os
import pickle
import subprocess
import textwrap
from pathlib import Path

import numpy as np
import pytest

from alpa_job.engines import plan_cache as pc
from alpa_job.errors import KitError

REPO = Path(__file__).resolve().parent.parent
VENV39_PY = REPO / ".venv39" / "bin" / "python"

SEED_DP = (
    None,
    [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]],
    [(1, 2), (1, 2)],
    [(1, 2), (1, 2)],
    [{"force_batch_dim_to_mesh_dim": 0}, {"force_batch_dim_to_mesh_dim": 0}],
)


def _key_inputs(**over):
    base = dict(
        config={"model": "wide_resnet", "model_args": {"depth": 16, "width": 2}, "dtype": "float32"},
        batch_signature=(("image", (64, 32, 32, 3), "float32"), ("label", (64,), "int32")),
        num_nodes=2,
        devices_per_node=2,
        device_kind="GTX_1080_Ti",
        versions={"alpa": "0.2.3", "jax": "0.3.22", "jaxlib": "0.3.22+cuda113.cudnn820"},
        method={"strategy": "pipeshard-auto", "micro_batches": 16, "layer_num": 16},
    )
    base.update(over)
    return pc.plan_key_inputs(**base)


def test_key_is_stable_and_covers_model_batch_cluster_versions():
    k = pc.plan_key(_key_inputs())
    assert k == pc.plan_key(_key_inputs()) and len(k) == 20
    changed = [
        _key_inputs(config={"model": "wide_resnet", "model_args": {"depth": 22, "width": 2}, "dtype": "float32"}),
        _key_inputs(batch_signature=(("image", (16, 32, 32, 3), "float32"), ("label", (16,), "int32"))),
        _key_inputs(num_nodes=1),
        _key_inputs(devices_per_node=4),
        _key_inputs(versions={"alpa": "0.2.3", "jax": "0.3.22", "jaxlib": "0.3.22+cuda111.cudnn805"}),
        _key_inputs(method={"strategy": "pipeshard-auto", "micro_batches": 8, "layer_num": 16}),
    ]
    assert len({pc.plan_key(c) for c in changed} | {k}) == len(changed) + 1


def test_profile_file_from_log_and_cwd(tmp_path):
    assert (
        pc.profile_file_from_log("x\nProfile result saved to: profile-results-2022-11-14-13-52-04.npy\n")
        == "profile-results-2022-11-14-13-52-04.npy"
    )
    assert pc.profile_file_from_log("nothing") is None
    np.save(tmp_path / "profile-results-2022-11-14-13-52-04.npy", {"a": 1})
    assert pc.find_profile_file("", str(tmp_path)).endswith("13-52-04.npy")  # fallback: newest in cwd
    assert pc.find_profile_file("", str(tmp_path / "empty")) is None


def test_tee_stdout_captures_and_passes_through(capsys):
    with pc.tee_stdout() as buf:
        print("Profile result saved to: profile-results-x.npy")
    assert "profile-results-x.npy" in buf.getvalue()
    assert "profile-results-x.npy" in capsys.readouterr().out


def test_round_trip_plain_dict(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    profile = {(0, 8, 0, 0): {"compute_cost": 1.5}, (8, 16, 0, 0): {"compute_cost": 2.5}}
    np.save("profile-results-2023-01-01-00-00-00.npy", profile)
    with open("profile-results-2023-01-01-00-00-00.npy", "rb") as f:
        with pytest.raises(pickle.UnpicklingError):  # why the conversion is needed
            pickle.load(f)
    cache = pc.PlanCache(str(tmp_path / "plans"))
    key = pc.plan_key(_key_inputs())
    assert cache.lookup(key) is None
    npy = pc.find_profile_file("Profile result saved to: profile-results-2023-01-01-00-00-00.npy", str(tmp_path))
    cache.save(key, _key_inputs(), SEED_DP, npy)
    entry = cache.lookup(key)
    assert pc.load_profile_like_alpa(entry["profile_path"]) == profile
    kw = pc.manual_stage_kwargs(entry["plan"])
    assert kw["submesh_physical_shapes"] == [(1, 2), (1, 2)]
    assert kw["forward_stage_layer_ids"] == SEED_DP[1]
    assert kw["submesh_autosharding_option_dicts"] == SEED_DP[4]
    assert pc.entries(str(tmp_path / "plans")) == [key]
    assert "hit" in pc.decision_line(key, "hit", "/plans") and key in pc.decision_line(key, "hit", "/plans")


def test_save_without_search_result_and_broken_entry(tmp_path):
    cache = pc.PlanCache(str(tmp_path))
    with pytest.raises(KitError, match="no auto-search result"):
        cache.save("k", {}, (None, None, None, None, None), None)
    os.makedirs(tmp_path / "bad")
    (tmp_path / "bad" / pc.PLAN_FILE).write_text("{not json")
    with pytest.raises(KitError, match="delete"):
        cache.lookup("bad")
    (tmp_path / "bad" / pc.PLAN_FILE).write_text(json.dumps({"key": "other", "plan": pc.dp_result_to_plan(SEED_DP)}))
    with pytest.raises(KitError, match="belongs to key other"):
        cache.lookup("bad")


def test_convert_rejects_non_dict(tmp_path):
    np.save(tmp_path / "p.npy", np.arange(3))
    with pytest.raises(KitError, match="not Alpa's dict"):
        pc.convert_profile(str(tmp_path / "p.npy"), str(tmp_path / "p.pkl"))


REAL_ALPA_SCRIPT = r'''
import ast, importlib.util, json, os, pickle, sys, types
from collections import namedtuple
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple
import numpy as np
from datetime import datetime
from alpa_job.engines import plan_cache as pc

root = list(importlib.util.find_spec("alpa").submodule_search_locations)[0]

def real_module(relpath, modname, names, ns):
    """Compile the named top-level classes of an installed alpa module into a module registered
    under the real module name (so pickles reference alpa's own class paths)."""
    for part in ("alpa", "alpa.pipeline_parallel"):
        sys.modules.setdefault(part, types.ModuleType(part))
    mod = types.ModuleType(modname)
    mod.__dict__.update(ns)
    sys.modules[modname] = mod
    src = open(os.path.join(root, relpath)).read()
    lines = src.splitlines()
    for node in ast.parse(src).body:
        if isinstance(node, ast.ClassDef) and node.name in names:
            first = min([d.lineno for d in node.decorator_list] + [node.lineno])  # keep @dataclass
            exec(compile("\n".join(lines[first - 1:node.end_lineno]), relpath, "exec"), mod.__dict__)
    return mod

GB = 1 << 30
sp = real_module("pipeline_parallel/stage_profiling.py", "alpa.pipeline_parallel.stage_profiling",
                 {"ModuleProfileResult", "StageProfileResult"},
                 {"namedtuple": namedtuple, "Sequence": Sequence, "GB": GB})
sc = real_module("pipeline_parallel/stage_construction.py", "alpa.pipeline_parallel.stage_construction",
                 {"ManualStageOption"}, {"dataclass": dataclass, "Sequence": Sequence, "Optional": Optional,
                                         "Tuple": Tuple, "np": np})

# the dict stage_profiling builds: {(start, end, mesh_id, config_idx): StageProfileResult}
profile_results = {}
for (start, end) in ((0, 8), (8, 16), (0, 16)):
    r = sp.StageProfileResult(2, ("p0", "p1"), (1024, 2048))
    for m in range(2):
        r.add_module_profile_result(m, sp.ModuleProfileResult(
            compute_cost=0.01 * (end - start) + m, peak_memory=3 * GB, temp_buffer_size=GB,
            invar_names=("a",), outvar_names=("b",), invar_sizes=(10,), outvar_sizes=(20,),
            donated_invars=(False,), acc_grad_invars_indices=(), acc_grad_outvars_indices=(),
            available_memory=8 * GB))
    profile_results[(start, end, 1, 0)] = r

os.chdir(sys.argv[1])
with pc.tee_stdout() as captured:
    # exactly stage_profiling.get_compute_cost's tail:
    timestamp = datetime.now().strftime("%Y-%m-%d-%H-%M-%S")
    profile_result_file_name = (f"profile-results-{timestamp}.npy")
    np.save(profile_result_file_name, profile_results)
    print(f"Profile result saved to: {profile_result_file_name}")

try:  # AutoStageOption's raw pickle.load cannot read the file Alpa itself wrote
    with open(profile_result_file_name, "rb") as f:
        pickle.load(f)
    raw_ok = True
except Exception:
    raw_ok = False

dp = (None, [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]], [(1, 2), (1, 2)], [(1, 2), (1, 2)],
      [{"force_batch_dim_to_mesh_dim": 0}, {"force_batch_dim_to_mesh_dim": 0}])
cache = pc.PlanCache(os.path.join(sys.argv[1], "plans"))
key = pc.plan_key({"demo": 1})
found = pc.find_profile_file(captured.getvalue(), os.getcwd())
cache.save(key, {"demo": 1}, dp, found)
entry = cache.lookup(key)

# what AutoStageOption(cached_profile_result=entry["profile_path"]) does, verbatim
with open(entry["profile_path"], "rb") as f:
    loaded = pickle.load(f)
same = (sorted(loaded) == sorted(profile_results) and
        all(type(loaded[k]) is sp.StageProfileResult and loaded[k].fully_profiled() and
            loaded[k].module_profile_results == profile_results[k].module_profile_results and
            loaded[k].available_memory == profile_results[k].available_memory for k in loaded))
opt = sc.ManualStageOption(**pc.manual_stage_kwargs(entry["plan"]))
print("JSON" + json.dumps({"raw_ok": raw_ok, "same": same, "found": os.path.basename(found),
                           "name": profile_result_file_name,
                           "stage_option": [opt.forward_stage_layer_ids, opt.submesh_physical_shapes,
                                            opt.submesh_logical_shapes, opt.submesh_autosharding_option_dicts],
                           "type": type(opt).__module__ + "." + type(opt).__name__}))
'''


@pytest.mark.skipif(not VENV39_PY.exists(), reason=f"{VENV39_PY} not found (see requirements/alpa-fixtures-py39.txt)")
def test_round_trip_with_real_alpa_classes(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    env["PYTHONPATH"] = str(REPO)
    script = tmp_path / "real_alpa_cache.py"
    script.write_text(textwrap.dedent(REAL_ALPA_SCRIPT))
    r = subprocess.run([str(VENV39_PY), str(script), str(tmp_path)], cwd=str(REPO), env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads(r.stdout.split("JSON", 1)[1])
    assert out["raw_ok"] is False  # the .npy Alpa writes is not what its pickle.load reads
    assert out["same"] is True  # the converted file is, with Alpa's own StageProfileResult objects
    assert out["found"] == out["name"]
    assert out["type"] == "alpa.pipeline_parallel.stage_construction.ManualStageOption"
    assert out["stage_option"] == [SEED_DP[1], [[1, 2], [1, 2]], [[1, 2], [1, 2]], SEED_DP[4]]
