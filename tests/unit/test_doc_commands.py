"""The shell commands of README.md and docs/*.md, run as written where they can run here.

Every command of a fenced shell block (and every command line of a plain fenced block) is either run here, in a
scratch folder, with the exit code the doc promises, or listed in EXCLUDED with the reason it cannot run here (a GPU,
a server, hardware, a download, an hour). A new doc command fails `test_every_doc_command_is_run_or_excluded` until it
is put in one list or the other, so a command a newcomer copies never goes stale unnoticed.

Commands of our own programs (`dreamzero-*`, `python -m <our module>`) run in this process through their entry point,
argv split as the shell splits it; the others (openssl, a pipe, a variable) run in bash with the virtualenv's `python`
first on PATH. A command that reads `demos/scene1` or `recorded/scene1` finds a small synthetic LeRobot dataset there.
"""

from __future__ import annotations

import os
import re
import runpy
import shlex
import subprocess
import sys
from dataclasses import dataclass
from importlib import import_module
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
SHELL_FENCES = ("bash", "sh", "shell", "console")
#: a command line inside a plain ``` block (plain blocks also hold diagrams, outputs and trees)
COMMAND_LINE = re.compile(r"^(dreamzero-[a-z]|python3? |serve |pip |\./scripts/|scripts/|curl |PYTHONPATH=|RAY_)")
DATASETS = ("demos/scene1", "recorded/scene1")
#: bash runs at most this long per block (openssl, sha256sum)
BASH_TIMEOUT_S = 120

#: command (a regular expression matched at its start) -> the exit code the doc promises
RUN = {
    r"dreamzero-plan --model libero_5b --gpu-memory 24GiB --json$": 0,
    r"dreamzero-plan --model droid_14b --gpu-memory 24GiB$": 1,  # "does not fit: exits 1 saying what would"
    r"dreamzero-make-metadata generate (demos|recorded)/scene1 --preset oxe_droid -o ": 0,
    r"python -m eval\.libero --help$": 0,
    r"(python -m dreamzero\.zmq_keys_cli|dreamzero-zmq-keys) keys/ ": 0,
    r"KEY=\$\(python -c ": 0,
    r'printf %s "\$KEY" \| sha256sum': 0,
    r"openssl ": 0,
    r'printf "subjectAltName=': 0,
}

#: command (a regular expression matched at its start) -> why it does not run here
EXCLUDED = {
    r"(DREAMZERO_TEST_WORKERS=\S+ )?\./scripts/test\.sh": "the whole test suite (this test is part of it)",
    r"(RAY_AUTH_MODE=.* )?\.venv/bin/pytest ": "runs tests of this suite, which runs them itself",
    r"\./scripts/serve\.sh|serve run |RAY_SERVE_ENABLE_HA_PROXY=1 ": "starts a server on port 8000 and keeps it",
    r"scripts/gpu-wheels\.sh": "downloads CUDA wheels",
    r"scripts/default_model\.sh": "records, trains and evaluates for hours",
    r"scripts/instruction_model\.sh": "records, trains and evaluates for hours",
    r"pip install ": "installs packages (the test venv has them)",
    r"huggingface-cli download ": "downloads checkpoints of tens of GB",
    r"dreamzero-plan --model /models/": "reads a 46 GB checkpoint at /models",
    r"dreamzero-eval( |$)": "needs a policy server or minutes of MuJoCo episodes (tests/unit/eval/test_cli.py runs it)",
    r"dreamzero-eval-libero |python -m eval\.libero\.offline": "needs LIBERO (the libero extra) and a server",
    r"dreamzero-franka ": "drives a Franka arm and RealSense cameras",
    r"dreamzero-train ": "trains for hours or needs a GPU checkpoint (tests/unit/train/test_loop.py trains tiny runs)",
    r"dreamzero-record-demos ": "records 200 MuJoCo episodes (tests/unit/eval/test_demos_record.py records a few)",
    r"dreamzero-export-video ": "runs the model for minutes (its section is parsed by test_cli_error_lines.py)",
    r"dreamzero-make-metadata generate /data/": "reads your dataset at /data",
    r"dreamzero-make-metadata merge all\.json ": "merges your metadata files",
    r"python -m dreamzero\.train\.ship runs/": "needs the fine-tuned checkpoint of the commands above it",
    r"PYTHONPATH=": "cluster tests and reliability benchmarks (minutes, run by the cluster tier)",
    r"curl ": "needs a running server",
    r"python benchmarks/fleet\.py": "measures fleets for minutes (tests/unit/benchmarks/test_fleet.py runs one)",
}


@dataclass(frozen=True)
class DocCommand:
    where: str  # file:line of the block
    block: int  # the block's index in the file: commands of one block share a folder and a shell
    text: str

    @property
    def bare(self) -> str:
        """The command without its trailing `# comment` (what the tables match)."""
        return re.sub(r"\s+#\s.*$", "", self.text)

    def __str__(self) -> str:
        return f"{self.where}: {self.text}"


def doc_commands() -> list[DocCommand]:
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        lang, start, body = None, 0, []
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if not line.startswith("```"):
                if lang is not None:
                    body.append(line)
                continue
            if lang is None:
                lang, start, body = line[3:].strip() or "plain", i, []
                continue
            if lang in SHELL_FENCES or lang == "plain":
                for text in "\n".join(body).replace("\\\n", " ").splitlines():
                    text = " ".join(text.split())
                    if lang == "plain" and not COMMAND_LINE.match(text):
                        continue
                    if text and not text.startswith("#"):
                        found.append(DocCommand(f"{path.relative_to(ROOT)}:{start}", start, text))
            lang = None
    return found


def _hits(table: dict, command: DocCommand) -> list:
    return [value for pattern, value in table.items() if re.match(pattern, command.bare)]


def test_every_doc_command_is_run_or_excluded():
    commands = doc_commands()
    assert len(commands) > 40, "the parser found too few doc commands"
    unplaced = [str(c) for c in commands if len(_hits(RUN, c)) + len(_hits(EXCLUDED, c)) != 1]
    assert not unplaced, "put each in RUN (it runs here) or EXCLUDED (with why not), once:\n" + "\n".join(unplaced)
    runs = [c for c in commands if _hits(RUN, c)]
    assert len(runs) >= 10, runs


def _scripts() -> dict[str, str]:
    """`dreamzero-*` -> `module:function`, from the pyproject files of this repository and its client packages."""
    scripts = {}
    for pyproject in [ROOT / "pyproject.toml", *sorted((ROOT / "clients").glob("*/pyproject.toml"))]:
        scripts |= tomllib.loads(pyproject.read_text()).get("project", {}).get("scripts", {})
    return scripts


def _run_in_process(argv: list[str]) -> int:
    saved = sys.argv
    try:
        if argv[0] == "python" and argv[1] == "-m":
            sys.argv = argv[2:]
            runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
            return 0
        module, function = _scripts()[argv[0]].split(":")
        return int(getattr(import_module(module), function)(argv[1:]) or 0)
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    finally:
        sys.argv = saved


def _blocks() -> dict[str, list[DocCommand]]:
    blocks: dict[str, list[DocCommand]] = {}
    for command in doc_commands():
        if _hits(RUN, command):
            blocks.setdefault(command.where, []).append(command)
    return blocks


@pytest.mark.slow
@pytest.mark.parametrize("where", sorted(_blocks()))
def test_the_doc_block_runs_as_written(where, tmp_path, monkeypatch, capsys):
    from tests.support.train_data import write_synthetic_dataset

    monkeypatch.chdir(tmp_path)
    shell_lines = []
    for command in _blocks()[where]:
        for dataset in DATASETS:
            if dataset in command.text and not (tmp_path / dataset).exists():
                write_synthetic_dataset(tmp_path / dataset, n_episodes=1, length=30, hw=(16, 16))
        (want,) = _hits(RUN, command)
        argv = shlex.split(command.bare)
        if argv[0] in _scripts() or argv[:2] == ["python", "-m"]:
            assert _run_in_process(argv) == want, f"{command}\n{capsys.readouterr()}"
        else:
            said = shlex.quote(f"not {want}: {command.bare}")
            check = f'rc=$?; [ $rc -eq {want} ] || {{ echo "exit $rc," {said} >&2; exit 1; }}'
            shell_lines.append(f"{command.text}\n{check}")
    if shell_lines:
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
        done = subprocess.run(
            ["bash", "-c", "\n".join(shell_lines)], env=env, capture_output=True, text=True, timeout=BASH_TIMEOUT_S
        )
        assert done.returncode == 0, f"{where}:\n{done.stderr}"
