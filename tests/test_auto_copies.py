"""`--strategy auto` ranking its candidates on shallow copies of the model (engines/shallow_ranking.py), on
emulated CPU devices: which models get copies, the prediction, and a real search that compiles only its
winner whole."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

from alpa_job import models
from alpa_job.engines import shallow_ranking
from alpa_job.launch.runner import run_in_process
from helpers_train import tiny_config


def test_a_figure_is_extrapolated_linearly_from_the_copies_to_the_whole_depth():
    assert shallow_ranking.DEPTHS == (1, 3)
    assert shallow_ranking.extrapolate([10.0, 30.0], 6) == pytest.approx(60.0)  # 10 + 5 layers x 10
    assert shallow_ranking.extrapolate([10.0, 30.0], 3) == pytest.approx(30.0)
    assert shallow_ranking.extrapolate([5.0, 5.0], 48) == pytest.approx(5.0)  # layers that cost nothing


def test_copies_timed_out_of_order_still_predict_a_positive_time_and_say_why():
    # Times from a CI run whose shallower copies ran beside a whole compile: a line through them falls below
    # zero, and no candidate could then be within the tie of the fastest.
    assert shallow_ranking.predict_step_time([0.010, 0.030], 6) == (pytest.approx(0.060), "")
    for shallow, deep in ((0.03594, 0.00909), (0.05949, 0.01154)):
        predicted, note = shallow_ranking.predict_step_time([shallow, deep], 6)
        assert predicted == pytest.approx(deep * 2) and "timed slower than the 3-layer one" in note


def _candidate(strategy, step_ms, peak_gb):
    return (
        {
            "strategy": strategy,
            "mesh_shape": [2, 1],
            "step_time_s": step_ms / 1e3,
            "peak_bytes_per_device": int(peak_gb * 1e9),
            "note": "predicted",
        },
        strategy,
    )


def test_of_candidates_predicted_within_the_tie_the_one_needing_least_memory_wins():
    least = shallow_ranking.least_memory_among_ties
    tie = shallow_ranking.TIE
    data, fsdp, tensor = _candidate("data", 130.0, 35.0), _candidate("fsdp", 130.0 * (1 + tie / 2), 27.0), _candidate("tensor", 140.0, 29.0)
    ranked = least([data, fsdp, tensor])
    assert [engine for _, engine in ranked] == ["fsdp", "data", "tensor"]
    # Every process decides on the peaks it is given (process 0's), not its own rows'.
    assert [engine for _, engine in least([data, fsdp, tensor], [20e9, 27e9, 29e9])][0] == "data"
    # Outside the tie the fastest wins whatever it needs; so does the fastest when it needs the least.
    slower = _candidate("fsdp", 130.0 * (1 + 2 * tie), 27.0)
    assert [engine for _, engine in least([data, slower, tensor])] == ["data", "fsdp", "tensor"]
    lean = _candidate("data", 129.0, 20.0)
    assert [engine for _, engine in least([lean, fsdp, tensor])][0] == "data"
    assert least([]) == []


def test_the_likeliest_winner_compiles_first_the_least_state_then_the_narrowest_model_axis():
    from alpa_job.engines import auto_search
    from alpa_job.engines.jax_engine import JaxEngine

    config = tiny_config("gpt", num_layers=2)
    model = models.get_model(config)
    batch = model.synthetic(np.random.default_rng(0), 16)
    batch["mask"] = np.ones(16, np.float32)
    replicated = tiny_config("gpt", num_layers=2, data_update="replicated")
    engines = [
        ({"strategy": name}, JaxEngine(cfg, model, batch, s, mesh))
        for name, cfg, s, mesh in (
            ("data replicated", replicated, "data", (8, 1)),
            ("tensor", config, "tensor", (4, 2)),
            ("fsdp", config, "fsdp", (8, 1)),
            ("data", config, "data", (8, 1)),
        )
    ]
    ordered = [row["strategy"] for row, _ in auto_search._likeliest_first(engines)]
    # fsdp and data (its update sharded) split every parameter and its optimizer state over the data axis
    # (a tie: the given order stays); tensor only the matmuls' inner widths, over 2 of the 8 devices; data's
    # replicated update splits nothing.
    assert ordered == ["fsdp", "data", "tensor", "data replicated"]


def test_the_copies_one_state_is_created_whole_and_every_layout_is_cut_from_it():
    """No candidate's own layout is whole (data splits its optimizer state), so auto's copies start from a
    state created whole on every device; each candidate's state is then a slice of it, the same values."""
    from alpa_job.engines.jax_engine import JaxEngine

    config = tiny_config("gpt", num_layers=2)
    model = models.get_model(config)
    batch = model.synthetic(np.random.default_rng(0), 16)
    batch["mask"] = np.ones(16, np.float32)
    source = JaxEngine(config, model, batch, "data", (8, 1))
    assert not all(leaf.sharding.is_fully_replicated for leaf in jax.tree_util.tree_leaves(source.abstract_state))
    source.initialise_replicated = True
    source.compile_step()
    template = source.init_state(config.seed)
    assert all(leaf.sharding.is_fully_replicated for leaf in jax.tree_util.tree_leaves(template))
    fsdp = JaxEngine(config, model, batch, "fsdp", (8, 1))
    state = fsdp.state_like(template)
    for mine, whole in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(template)):
        np.testing.assert_array_equal(np.asarray(mine), np.asarray(whole))
    assert any(not leaf.sharding.is_fully_replicated for leaf in jax.tree_util.tree_leaves(state))


@pytest.mark.parametrize(
    "model, overrides, expected",
    [
        ("gpt", dict(num_layers=6, auto_rank_on="copies"), 6),
        ("gpt", dict(num_layers=5, auto_rank_on="copies"), None),  # copies would cost about a whole compile
        ("gpt", dict(num_layers=6, auto_rank_on="whole"), None),
        ("gpt", dict(num_layers=6), 6),  # the default
        ("mlp", dict(auto_rank_on="copies"), None),  # declares no depth_setting
    ],
)
def test_only_a_model_that_declares_its_depth_and_is_deep_enough_is_ranked_on_copies(model, overrides, expected, capfd):
    config = tiny_config(model, strategy="auto", **overrides)
    copies = shallow_ranking.copies_for(config, models.get_model(config))
    if expected is None:
        assert copies is None
        said = capfd.readouterr().err
        asked = config.auto_rank_on == "copies"
        assert ("ranking the candidates whole, not on copies" in said) == asked, said  # asked for, so told why
        return
    assert copies.full_depth == expected
    assert [c.model_args["num_layers"] for c, _ in copies.configs_and_models] == list(shallow_ranking.DEPTHS)
    assert [m.layer_count for _, m in copies.configs_and_models] == list(shallow_ranking.DEPTHS)


def test_state_like_reshards_a_state_and_cuts_a_deeper_copys_to_its_own_layers():
    from alpa_job.engines.jax_engine import JaxEngine

    config = tiny_config("gpt", num_layers=3, steps=1)
    model = models.get_model(config)
    batch = model.synthetic(np.random.default_rng(0), 16)
    batch["mask"] = np.ones(16, np.float32)
    data = JaxEngine(config, model, batch, "data", (8, 1))
    fsdp = JaxEngine(config, model, batch, "fsdp", (8, 1))
    shallow_config, shallow_model = models.at_depth(config, model, 1)
    shallow = JaxEngine(shallow_config, shallow_model, batch, "tensor", (4, 2))
    data.compile()
    for engine in (fsdp, shallow):
        engine.compile_step(with_initializer=False)
    original = data.init_state(0)
    moved = fsdp.state_like(original)
    for a, b, sharding in zip(
        jax.tree_util.tree_leaves(original), jax.tree_util.tree_leaves(moved), jax.tree_util.tree_leaves(fsdp.state_sharding)
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert b.sharding == sharding
    cut = shallow.state_like(original)
    assert set(cut.params) == {"wte", "wpe", "DecoderBlock_0", "LayerNorm_0"}
    np.testing.assert_array_equal(
        np.asarray(cut.params["DecoderBlock_0"]["Dense_0"]["kernel"]), np.asarray(original.params["DecoderBlock_0"]["Dense_0"]["kernel"])
    )
    with pytest.raises(ValueError, match="DecoderBlock_1"):
        data.state_like(cut)  # a shallower state has no layers to give a deeper one
    _, moved_loss = fsdp.step(moved, fsdp.put_batch(batch))  # donates `moved`, not `original`
    _, cut_loss = shallow.step(cut, shallow.put_batch(batch))
    _, loss = data.step(original, data.put_batch(batch))
    assert float(loss) == pytest.approx(float(moved_loss), rel=1e-4) and math.isfinite(float(cut_loss))


def test_auto_on_copies_predicts_each_candidate_and_compiles_only_the_winner_whole(tmp_path):
    config = tiny_config(
        "gpt",
        num_layers=6,
        steps=2,
        strategy="auto",
        auto_rank_on="copies",
        auto_trial_steps=1,
        compile_cache=str(tmp_path / "cache"),
        out=str(tmp_path / "a"),
    )
    result = run_in_process(config)
    timed = [r for r in result.search if r.step_time_s]
    assert len(timed) >= 3
    for row in timed:
        assert row.predicted_from == [1, 3] and len(row.copy_step_time_s) == 2
        assert row.step_time_s == pytest.approx(shallow_ranking.predict_step_time(row.copy_step_time_s, 6)[0])
        assert "predicted for 6 layers from copies with 1 and 3" in row.note
    chosen = [r for r in result.search if r.chosen]
    fastest = min(r.step_time_s for r in timed)
    assert len(chosen) == 1 and chosen[0].step_time_s <= fastest * (1 + shallow_ranking.TIE)
    ties = [r for r in timed if r.step_time_s <= fastest * (1 + shallow_ranking.TIE)]
    assert chosen[0].peak_bytes_per_device == min(r.peak_bytes_per_device for r in ties)
    # The report says why whenever the memory rule, not the time, decided.
    assert ("chosen over the fastest prediction" in chosen[0].note) == (chosen[0].step_time_s > fastest)
    assert chosen[0].whole_compile_s and all(r.whole_compile_s is None for r in result.search if not r.chosen)
    assert (result.strategy, result.mesh.shape) == (chosen[0].strategy, chosen[0].mesh_shape)
    assert result.compiles == 1 and result.steps == 2 and all(math.isfinite(x) for x in result.losses)
    # The memory predicted from the copies against XLA's estimate for the whole step that trained.
    assert chosen[0].peak_bytes_per_device == pytest.approx(result.memory.peak_estimate_bytes, rel=0.1)

    again = run_in_process(config.replace(out=str(tmp_path / "b")))
    assert (again.strategy, again.mesh.shape) == (result.strategy, result.mesh.shape)
    assert all("(from the saved search)" in r.note for r in again.search)
