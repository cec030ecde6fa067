"""What a newcomer's mistakes look like on each command line: a configuration error is one `error: ...` line on stderr
and exit code 2, never a traceback; `--help` shows every option's default, once; `dreamzero-export-video` says what
it is doing on stderr while it runs."""

from __future__ import annotations

import argparse
import io
from types import SimpleNamespace

import numpy as np
import pytest

from dreamzero.embodiments import get_embodiment
from dreamzero.errors import ConfigError
from tests.support.embodiments import droid_metadata
from tests.support.train_data import write_synthetic_dataset


def _one_error_line(err: str, *words: str) -> str:
    """The one `error:` line of stderr (progress lines may come before it), with no traceback anywhere."""
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in err and err.rstrip().endswith(errors[0]), err
    for word in words:
        assert word in errors[0], (word, errors[0])
    return errors[0]


# ---------------------------------------------------------------------------------------------------------------------
# dreamzero-train
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        ([], ("--dataset",)),
        (["--dataset", "/srv/nowhere/demos"], ("/srv/nowhere/demos", "no such directory")),
        (["--dataset", "x", "--preset", "small", "--init", "y"], ("--preset", "--init")),
    ],
)
def test_train_configuration_errors_are_one_line(argv, words, tmp_path, capsys):
    from dreamzero.train.cli import main

    assert main([*argv, "--out", str(tmp_path / "run")]) == 2
    _one_error_line(capsys.readouterr().err, *words)


def test_train_a_checkpoint_that_does_not_load_is_one_line(tmp_path, capsys):
    from dreamzero.train.cli import main

    ds = write_synthetic_dataset(tmp_path / "ds", n_episodes=1, length=30, hw=(16, 16))
    argv = ["--dataset", str(ds), "--init", str(tmp_path / "missing"), "--out", str(tmp_path / "run"), "--steps", "1"]
    assert main(argv) == 2
    _one_error_line(capsys.readouterr().err, "missing")


# ---------------------------------------------------------------------------------------------------------------------
# dreamzero-record-demos
# ---------------------------------------------------------------------------------------------------------------------


def test_record_demos_configuration_errors_are_one_line(tmp_path, capsys):
    from eval.mujoco_droid.record import main

    assert main(["--out", str(tmp_path / "a"), "--workers", "0"]) == 2
    _one_error_line(capsys.readouterr().err, "--workers")
    assert main(["--out", str(tmp_path / "b"), "--episodes", "0"]) == 2
    _one_error_line(capsys.readouterr().err, "episodes")
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "meta").mkdir()
    assert main(["--out", str(taken)]) == 2  # refused before recording anything, not after
    _one_error_line(capsys.readouterr().err, "--out", str(taken))


# ---------------------------------------------------------------------------------------------------------------------
# dreamzero-eval and dreamzero-export-video
# ---------------------------------------------------------------------------------------------------------------------


def test_eval_configuration_errors_are_one_line(tmp_path, capsys):
    from eval.cli import main

    assert main(["--episodes", "0", "--out", str(tmp_path)]) == 2
    _one_error_line(capsys.readouterr().err, "--episodes")
    assert main(["--policy", "embedded", "--model-path", str(tmp_path / "missing"), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    _one_error_line(err, "missing")
    assert f"--policy embedded runs {tmp_path / 'missing'}" in err  # which model, said before it loads


def test_eval_embedded_without_a_path_runs_the_shipped_default():
    from dreamzero.embedded_default import SHIPPED_DEFAULT
    from eval.cli import parse_args

    assert parse_args(["--policy", "embedded"]).model_path == SHIPPED_DEFAULT


def test_export_video_errors_are_one_line_after_its_progress(tmp_path, capsys):
    from dreamzero.export_video import main

    argv = ["--dataset", str(tmp_path), "--model-path", str(tmp_path / "missing"), "--out", str(tmp_path / "o")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"loading {tmp_path / 'missing'}" in err
    _one_error_line(err, "missing")


def test_export_video_reports_each_chunk_as_it_goes(tmp_path):
    """The export loop with a stand-in policy (zero frames): one progress line per chunk, then the writing."""
    from dreamzero.export_video import export

    embodiment = get_embodiment("oxe_droid", droid_metadata())

    class Frames:
        def __init__(self):
            self.embodiment = embodiment

        def infer(self, obs, *args, **kwargs):
            return SimpleNamespace(video=np.zeros((1, 2, 16, 32, 3), np.uint8))

    n = 3 * embodiment.action_horizon
    views = {k: np.zeros((n, 48, 64, 3), np.uint8) for k in embodiment.video_keys}
    state = {k: np.zeros((n, len(embodiment.state_normalisers[k].q01))) for k in embodiment.state_keys}
    lines: list[str] = []
    summary = export(Frames(), views, state, "pick", tmp_path / "out", None, False, 5, lines.append)
    assert summary["chunks"] == 3
    assert [line.split(" (")[0] for line in lines] == ["chunk 1/3", "chunk 2/3", "chunk 3/3", f"writing the videos to "
                                                       f"{tmp_path / 'out'}"]  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------------
# dreamzero-make-metadata, dreamzero-plan, dreamzero-eval-libero, dreamzero-franka
# ---------------------------------------------------------------------------------------------------------------------


def test_make_metadata_errors_are_one_line(tmp_path, capsys):
    from dreamzero.metadata_cli import main

    out = str(tmp_path / "metadata.json")
    assert main(["generate", "/srv/nowhere/demos", "--preset", "oxe_droid", "-o", out]) == 2
    _one_error_line(capsys.readouterr().err, "/srv/nowhere/demos", "info.json")
    assert main(["generate", str(tmp_path), "-o", out]) == 2
    _one_error_line(capsys.readouterr().err, "--preset", "--tag")
    assert main(["merge", out, "/srv/nowhere/b.json"]) == 2
    _one_error_line(capsys.readouterr().err, "/srv/nowhere/b.json")


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--model", "droid_14b"], ("--gpu-memory",)),
        (["--model", "/srv/nowhere/ckpt", "--gpu-memory", "80GiB"], ("/srv/nowhere/ckpt", "presets")),
        (["--model", "droid_14b", "--gpu-memory", "lots"], ("--gpu-memory", "40GiB")),
    ],
)
def test_plan_errors_are_one_line(argv, words, capsys):
    from dreamzero.plan_cli import main

    assert main(argv) == 2
    _one_error_line(capsys.readouterr().err, *words)


def test_eval_libero_errors_are_one_line_before_waiting_for_a_server(tmp_path, capsys):
    """Checked before the wait for the server (up to --ready-timeout-s): no server is running here."""
    from eval.libero.cli import main

    assert main(["--num-envs", "0", "--out", str(tmp_path)]) == 2
    _one_error_line(capsys.readouterr().err, "num_envs")
    assert main(["--suite", "libero_nowhere", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    _one_error_line(err, "libero_nowhere", "libero_spatial")
    assert "waiting" not in err


def test_zmq_keys_errors_are_one_line(tmp_path, monkeypatch, capsys):
    import sys

    from dreamzero.zmq_keys_cli import main

    assert main([str(tmp_path / "keys"), "/srv/nowhere/server"]) == 2  # a path as the name would write outside
    _one_error_line(capsys.readouterr().err, "name", "/srv/nowhere/server")
    assert not (tmp_path / "keys").exists()
    (tmp_path / "file").write_text("")
    assert main([str(tmp_path / "file"), "server"]) == 2  # a folder that cannot be made
    _one_error_line(capsys.readouterr().err, str(tmp_path / "file"))
    monkeypatch.setitem(sys.modules, "zmq", None)  # as without pyzmq
    monkeypatch.setitem(sys.modules, "zmq.auth", None)
    assert main([str(tmp_path / "keys"), "server"]) == 2
    _one_error_line(capsys.readouterr().err, "pip install 'pyzmq")


def test_franka_errors_are_one_line(capsys):
    from dreamzero_franka.cli import main

    assert main(["--server", "ws://127.0.0.1:1", "--prompt", "x", "--robot", "franky"]) == 2
    _one_error_line(capsys.readouterr().err, "--robot-ip")


# ---------------------------------------------------------------------------------------------------------------------
# --help
# ---------------------------------------------------------------------------------------------------------------------


def _parsers() -> dict[str, argparse.ArgumentParser]:
    from dreamzero.export_video import build_parser as export_parser
    from dreamzero.metadata_cli import _build_parser as metadata_parser
    from dreamzero.plan_cli import _parser as plan_parser
    from dreamzero.train.cli import _parser as train_parser
    from eval.cli import build_parser as eval_parser
    from eval.libero.cli import build_parser as libero_parser
    from eval.mujoco_droid.record import _parser as record_parser

    metadata = metadata_parser()
    (sub,) = [a for a in metadata._actions if isinstance(a, argparse._SubParsersAction)]
    return {"dreamzero-train": train_parser(), "dreamzero-eval": eval_parser(), "dreamzero-eval-libero":
            libero_parser(), "dreamzero-record-demos": record_parser(), "dreamzero-export-video": export_parser(),
            "dreamzero-make-metadata generate": sub.choices["generate"], "dreamzero-plan": plan_parser()}  # fmt: skip


@pytest.mark.parametrize("name", sorted(_parsers()))
def test_help_shows_each_default_once(name):
    parser = _parsers()[name]
    for action in parser._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS:
            continue
        formatter = parser._get_formatter()
        formatter.add_argument(action)
        text = " ".join(formatter.format_help().split())  # the option's lines in --help, unwrapped
        meaningful = action.default not in (None, False, [], (), argparse.SUPPRESS)
        if meaningful:
            assert "default" in text, f"{name} {action.option_strings[-1]}: no default in {text!r}"
        assert text.count("(default") <= 1 and "(default: None)" not in text, f"{name}: {text!r}"


def test_help_prints_and_wraps_without_error(capsys):
    for parser in _parsers().values():
        parser.print_help(io.StringIO())
    from dreamzero.train.cli import main

    with pytest.raises(SystemExit) as info:
        main(["--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0 and "--steps STEPS" in out and "(default: 100)" in out


def test_a_bad_config_error_subclass_still_counts(capsys):
    """A ConfigError raised deep in the run (here: at the model's load) gets the same one line."""
    from dreamzero.train import cli

    def refuse(args):
        raise ConfigError("lora_rank: the checkpoint was trained with rank 4, got 8")

    original, cli._run = cli._run, refuse
    try:
        assert cli.main(["--out", "/srv/runs/x"]) == 2
    finally:
        cli._run = original
    _one_error_line(capsys.readouterr().err, "lora_rank")


def test_the_export_video_doc_section_matches_the_command():
    """docs/serving.md's section (the one the README links): its commands parse as written, its table's defaults are
    the parser's."""
    import re
    import shlex
    from pathlib import Path

    from dreamzero.export_video import build_parser

    doc = (Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text()
    section = doc.split("### Offline: `dreamzero-export-video`", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    commands = [shlex.split(line, comments=True) for line in block.splitlines() if line.strip()]
    assert len(commands) == 2
    parser = build_parser()
    for argv in commands:
        assert argv[0] == "dreamzero-export-video"
        parser.parse_args(argv[1:])
    table = dict(re.findall(r"^\| `(--[\w-]+)` \| `([^`]+)` \|", section, flags=re.M))
    defaults = {a.option_strings[-1]: a.default for a in parser._actions if a.option_strings}
    assert table and {k: str(defaults[k]) for k in table} == table
    assert "smear" in section and "VAE" in section


def test_eval_shows_progress_unless_told_not_to(tmp_path, monkeypatch, capsys):
    """Progress by default (a bar on a terminal, plain lines in a log: tests/unit/model/test_progress_lines.py), none
    with --no-progress."""
    import eval.cli
    import eval.runner

    seen = []

    def fake_run(env_factory, policy, config, show_progress=False):
        seen.append(show_progress)
        raise ConfigError("stop here")

    monkeypatch.setattr(eval.runner, "run_evaluation", fake_run)
    monkeypatch.setattr(eval.cli, "make_policy", lambda args: SimpleNamespace(close=lambda: None))

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    for stream, argv in ((io.StringIO(), []), (Terminal(), []), (Terminal(), ["--no-progress"])):
        monkeypatch.setattr("sys.stderr", stream)
        assert eval.cli.main([*argv, "--out", str(tmp_path)]) == 2
        _one_error_line(stream.getvalue(), "stop here")
    assert seen == [True, True, False]


def test_the_random_model_warning_names_each_tool_s_flag(caplog):
    from dreamzero.embedded_default import default_model_dir

    with caplog.at_level("WARNING", logger="dreamzero.embedded_default"):
        default_model_dir()
    (message,) = [r.getMessage() for r in caplog.records if "EMBEDDED DEFAULT MODEL IN USE" in r.getMessage()]
    assert "--init (dreamzero-train)" in message and "model_path" in message and "--model-path" in message
