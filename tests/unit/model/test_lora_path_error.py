"""A LoRA run's checkpoint (adapters only) given where a model path is read: the error names LoRA and the merge
command that makes it loadable, and that command exists as written."""

from __future__ import annotations

import re

import pytest

from dreamzero.checkpoint import load_model
from dreamzero.checkpoint.loader import detect_layout
from dreamzero.errors import CheckpointError
from dreamzero.train import lora


@pytest.fixture
def lora_checkpoint(tmp_path):
    ckpt = tmp_path / "checkpoint-0000400"
    ckpt.mkdir()
    (ckpt / lora.ADAPTER_CONFIG).write_text('{"base_model": "/srv/models/base", "rank": 4, "alpha": 4}')
    (ckpt / lora.ADAPTER_WEIGHTS).write_bytes(b"")
    return ckpt


def test_a_lora_checkpoint_is_named_with_its_merge_command(lora_checkpoint):
    for call in (detect_layout, load_model):
        with pytest.raises(CheckpointError, match="LoRA checkpoint") as info:
            call(lora_checkpoint)
        command = re.search(r"`python -m (\S+) (\S+) (\S+) <merged>`", str(info.value))
        assert command is not None, str(info.value)
        assert command.groups() == ("dreamzero.train.lora", "merge", str(lora_checkpoint))


def test_the_named_merge_command_is_the_lora_module_s(capsys):
    with pytest.raises(SystemExit) as exit_info:
        lora.main(["merge", "--help"])
    assert exit_info.value.code == 0 and "checkpoint" in capsys.readouterr().out


def test_a_folder_with_neither_keeps_the_layout_list(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint layout we know") as info:
        detect_layout(tmp_path)
    assert "LoRA" not in str(info.value)
