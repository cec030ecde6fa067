"""The memory planner (dreamzero.planner, `dreamzero-plan`): the released checkpoints on the five usual cards meet the
goals docs/model.md states, the row pricing stays fixed, explicit settings are honoured, refusals say what would fit."""

from __future__ import annotations

import json

import pytest

from dreamzero import memory_fit
from dreamzero.config import preset
from dreamzero.errors import ConfigError
from dreamzero.plan_cli import card_table, main
from dreamzero.planner import CARDS, check_fits, model_config_for, plan_serving

G = 2**30
C24, C32, C48, C80, C141 = CARDS.values()


def card_goals_failures(table) -> list[str]:
    """What the card table misses of the goals (docs/model.md, "Fitting a card"); empty when every goal holds."""
    libero, droid = table.plans["RLinf 5B LIBERO"], table.plans["DROID 14B"]
    want = []
    cards = list(CARDS)

    def need(ok: bool, what: str) -> None:
        if not ok:
            want.append(what)

    p = [libero[c] for c in cards]
    need(p[0].fits and p[0].sessions >= 16, f"5B on 24 GB: >= 16 sessions, got {p[0].sessions}")
    need(p[1].fits and p[1].sessions >= 32, f"5B on 32 GB: >= 32 sessions, got {p[1].sessions}")
    need(p[2].fits and p[2].sessions >= 64, f"5B on 48 GB: >= 64 sessions, got {p[2].sessions}")
    need(p[3].sessions == 128 and p[3].rows >= 32, f"5B on 80 GB: 128 sessions, >= 32 rows: {p[3].summary()}")
    need(p[4].sessions == 128 and p[4].rows >= 64, f"5B on 141 GB: 128 sessions, >= 64 rows: {p[4].summary()}")
    d = [droid[c] for c in cards]
    need(not d[0].fits and bool(d[0].suggestions), "14B on 24 GB: refused, naming what would fit")
    need(d[1].fits, "14B on 32 GB: starts (fp8)")
    need(d[2].fits and d[2].sessions >= 1, "14B on 48 GB: >= 1 session")
    need(
        d[3].fits and d[3].placement.dit_weights == "model" and d[3].sessions >= 3,
        f"14B on 80 GB: bf16, >= 3 sessions: {d[3].summary()}",
    )
    need(
        d[4].placement.dit_weights == "model" and d[4].sessions >= 6 and d[4].rows >= 2,
        f"14B on 141 GB: bf16, >= 6 sessions and >= 2 rows: {d[4].summary()}",
    )
    return want


@pytest.fixture(scope="module")
def table():
    return card_table()


def test_released_checkpoints_meet_the_card_goals(table):
    assert card_goals_failures(table) == []


def test_the_old_row_pricing_put_back_fails_the_goals(monkeypatch):
    # every row priced with six full copies of its cache (the defect that refused the 14B on an 80 GB card)
    monkeypatch.setattr(memory_fit, "kv_transient", lambda rows, kv, layers: 2 * 3 * rows * kv)
    from dreamzero import planner

    planner._SIZES.clear()
    failures = card_goals_failures(card_table())
    assert any("14B on 80 GB" in f for f in failures) and any("14B on 141 GB" in f for f in failures), failures


def test_fp8_only_where_the_model_dtype_holds_no_session(table):
    for row in table.plans.values():
        for plan in row.values():
            if plan.fits and plan.placement.dit_weights == "fp8":
                bf16 = plan_serving(
                    preset("droid_14b"), plan.gpu_memory, placement={"dit_weights": "model"}, name="bf16"
                )
                assert not bf16.fits


def test_a_refusal_names_what_would_fit(table):
    refused = table.plans["DROID 14B"]["24 GB (RTX 4090)"]
    text = " ".join(refused.suggestions)
    assert "cfg_parallel: 2" in text and "32 GB" in text
    with pytest.raises(ConfigError, match="model_path: .*what would: .*cfg_parallel: 2"):
        check_fits(refused, "auto", "auto", {})


def test_explicit_settings_are_honoured_and_named_when_they_cannot_fit():
    cfg = preset("droid_14b")
    kept = plan_serving(cfg, C141, placement={"text_encoder": "gpu", "image_encoder": "auto", "dit_weights": "fp8"})
    assert kept.placement.text_encoder == "gpu" and kept.placement.dit_weights == "fp8"
    too_many = plan_serving(cfg, C80, rows=8)
    assert not too_many.fits
    with pytest.raises(ConfigError, match="batching.max_batch_rows=8"):
        check_fits(too_many, 8, "auto", {})
    assert any("1 row does" in s for s in too_many.suggestions)
    with pytest.raises(ConfigError, match="policy.placement.text_encoder='disk'"):
        plan_serving(cfg, C80, placement={"text_encoder": "disk"})


def test_cfg_parallel_halves_what_a_session_holds():
    cfg = preset("droid_14b")
    one, two = plan_serving(cfg, C80), plan_serving(cfg, C80, cfg_parallel=2)
    assert two.session_bytes < 0.6 * one.session_bytes and two.sessions > one.sessions


def test_cpu_and_offload_encoders_leave_the_gpu_and_say_their_cost():
    cfg = preset("libero_5b")
    for where in ("cpu", "offload"):
        plan = plan_serving(cfg, C24, placement={"text_encoder": where})
        text = next(c for c in plan.components if c.name == "text_encoder")
        assert (text.where, text.device_bytes) == (where, 0) and text.host_bytes > 10 * G
        assert plan.new_prompt_extra_s > 0 and plan.new_prompt_basis
    on_gpu = plan_serving(cfg, C141, placement={"text_encoder": "gpu"})
    assert on_gpu.new_prompt_extra_s == 0


def test_rows_fit_their_own_sessions_and_the_copies_are_cheap():
    fit = memory_fit.fit_rows(
        free=100 * G, total=141 * G, session_peak=9 * G, kv_peak=9 * G, activation_per_row=G, num_layers=40,
        max_rows=64,
    )  # fmt: skip
    assert fit.sessions >= fit.rows >= 8 and fit.transient < 9 * G
    assert memory_fit.fit_rows(5 * G, 141 * G, 9 * G, 9 * G, G, 40, 64) is None


def test_model_config_for_reads_presets_and_checkpoint_folders(tmp_path):
    from dreamzero.checkpoint import save_model
    from dreamzero.model.dreamzero import DreamZeroModel

    assert model_config_for("droid_14b").dit.num_layers == 40
    folder = save_model(DreamZeroModel.from_config(preset("tiny")), tmp_path / "tiny")
    assert model_config_for(str(folder)).dit.dim == preset("tiny").dit.dim
    with pytest.raises(ConfigError):
        model_config_for(str(tmp_path / "missing"))


def test_cli_prints_a_plan_json_and_refusals(capsys):
    assert main(["--model", "droid_14b", "--gpu-memory", "78GiB"]) == 0
    out = capsys.readouterr().out
    assert "rows per model call" in out and "dit" in out
    assert main(["--model", "libero_5b", "--gpu-memory", "24GiB", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] and plan["sessions"] >= 16 and plan["placement"]["text_encoder"] != "gpu"
    assert main(["--model", "droid_14b", "--gpu-memory", "23.6GiB"]) == 1
    assert "what would fit" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "droid_14b", "--gpu-memory", "lots"], "--gpu-memory"),
        (["--model", "droid_14c", "--gpu-memory", "80GiB"], "droid_14c"),
        (["--model", "droid_14b"], "--gpu-memory"),
        (["--model", "droid_14b", "--gpu-memory", "80GiB", "--rows", "0"], "--rows"),
        (["--model", "droid_14b", "--gpu-memory", "80GiB", "--text-encoder", "ssd"], "text_encoder"),
    ],
)
def test_cli_mistakes_are_one_line_and_exit_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_the_docs_table_is_the_planners(table):
    from pathlib import Path

    from dreamzero.plan_cli import TABLE_END, TABLE_START

    doc = (Path(__file__).resolve().parents[3] / "docs" / "model.md").read_text()
    shown = doc.split(TABLE_START, 1)[1].split(TABLE_END, 1)[0].strip()
    assert shown == table.markdown(), "regenerate: dreamzero-plan --table --write-docs docs/model.md"


def test_serve_config_placement_is_validated_naming_the_field():
    from serve_graph.config import parse_app_args

    ok = parse_app_args({"policy": {"placement": {"text_encoder": "auto", "dit_weights": "fp8"}}})
    assert ok.policy.placement == {"text_encoder": "auto", "dit_weights": "fp8"}
    with pytest.raises(ConfigError, match=r"args.policy.placement: text_encoder='disk': use one of"):
        parse_app_args({"policy": {"placement": {"text_encoder": "disk"}}})
    with pytest.raises(ConfigError, match=r"args.policy.placement: unknown key\(s\) \['txt'\]"):
        parse_app_args({"policy": {"placement": {"txt": "cpu"}}})
