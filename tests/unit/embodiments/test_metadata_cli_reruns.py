"""`dreamzero-make-metadata generate` as the docs write it, and run again onto its own output: the commands of
docs/training.md run as written; a second run refuses before computing anything, naming `--overwrite`; `--merge`
refuses a tag the file already holds unless `--overwrite` says so."""

from __future__ import annotations

import io
import json
import re
import shlex
from pathlib import Path

import pytest

import dreamzero.metadata_cli as metadata_cli
from tests.support.train_data import write_synthetic_dataset

DOC = Path(__file__).resolve().parents[3] / "docs" / "training.md"


def _doc_commands() -> list[list[str]]:
    lines = re.findall(r"^(dreamzero-make-metadata generate [^\n`]*)$", DOC.read_text(), flags=re.M)
    return [shlex.split(line)[1:] for line in lines]


def _one_error_line(err: str, *words: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    for word in words:
        assert word in lines[0], (word, lines[0])


@pytest.fixture
def no_statistics(monkeypatch):
    """Fails the test if the statistics are computed at all (a refusal must come before them)."""

    def refuse(*args, **kwargs):
        raise AssertionError("statistics computed before the refusal")

    monkeypatch.setattr(metadata_cli, "compute_metadata", refuse)


def test_the_training_doc_commands_run_as_written_then_refuse_a_second_run(tmp_path, monkeypatch, capsys):
    commands = _doc_commands()
    assert len(commands) >= 2, "docs/training.md lost its dreamzero-make-metadata commands"
    monkeypatch.chdir(tmp_path)
    for argv in commands:
        write_synthetic_dataset(Path(argv[1]), n_episodes=2, length=30, hw=(16, 16))
        assert metadata_cli.main(argv) == 0, capsys.readouterr().err
        output = Path(argv[argv.index("-o") + 1])
        assert "oxe_droid" in json.loads(output.read_text())
    capsys.readouterr()
    with monkeypatch.context() as m:
        m.setattr(metadata_cli, "compute_metadata", lambda *a, **k: pytest.fail("computed before refusing"))
        assert metadata_cli.main(commands[0]) == 2
    _one_error_line(capsys.readouterr().err, "--overwrite", "--merge")
    assert metadata_cli.main([*commands[0], "--overwrite"]) == 0


def test_merge_refuses_a_tag_the_file_holds_unless_overwrite(tmp_path, capsys):
    root = write_synthetic_dataset(tmp_path / "ds", n_episodes=2, length=30, hw=(16, 16))
    out = tmp_path / "metadata.json"
    out.write_text(json.dumps({"oxe_droid": {"statistics": "the earlier run's"}}))
    argv = ["generate", str(root), "--preset", "oxe_droid", "-o", str(out), "--merge"]
    assert metadata_cli.main(argv) == 2
    _one_error_line(capsys.readouterr().err, "'oxe_droid'", "--overwrite")
    assert json.loads(out.read_text())["oxe_droid"] == {"statistics": "the earlier run's"}  # untouched
    out.unlink()
    assert metadata_cli.main(argv) == 0  # no file yet: --merge writes it
    first = json.loads(out.read_text())["oxe_droid"]
    assert metadata_cli.main([*argv, "--overwrite"]) == 0
    assert json.loads(out.read_text())["oxe_droid"] == first


def test_the_refusals_come_before_the_statistics(tmp_path, no_statistics, capsys):
    root = write_synthetic_dataset(tmp_path / "ds", n_episodes=1, length=30, hw=(16, 16))
    out = tmp_path / "metadata.json"
    out.write_text(json.dumps({"oxe_droid": {}}))
    assert metadata_cli.main(["generate", str(root), "--preset", "oxe_droid", "-o", str(out)]) == 2
    _one_error_line(capsys.readouterr().err, "--overwrite")
    assert metadata_cli.main(["generate", str(root), "--preset", "oxe_droid", "-o", str(out), "--merge"]) == 2
    _one_error_line(capsys.readouterr().err, "'oxe_droid'", "--overwrite")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_progress_bar_goes_to_a_terminal_only(tmp_path, monkeypatch):
    root = write_synthetic_dataset(tmp_path / "ds", n_episodes=1, length=30, hw=(16, 16))
    argv = ["generate", str(root), "--preset", "oxe_droid", "-o"]
    for stream, shown in ((io.StringIO(), False), (_Terminal(), True)):
        monkeypatch.setattr("sys.stderr", stream)
        assert metadata_cli.main([*argv, str(tmp_path / f"{shown}.json")]) == 0
        assert ("oxe_droid: episodes" in stream.getvalue()) == shown
