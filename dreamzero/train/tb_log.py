"""What a person watches during a run: TensorBoard event files and a console progress bar.

`<out>/tensorboard/` gets one scalar per logged number under `train/` (loss, video_loss, action_loss, grad_norm, lr,
samples_per_s), at the step it was logged, beside the JSONL log that scripts read; `tensorboard --logdir <out>`
shows them. The progress bar (tqdm, on stderr) shows the step, the loss and samples/s when stderr is a terminal.
"""

from __future__ import annotations

from pathlib import Path

TB_DIR = "tensorboard"
SCALARS = ("loss", "video_loss", "action_loss", "grad_norm", "lr", "samples_per_s")


class RunLog:
    """Event files + progress bar of one run (worker 0 only); a context manager that closes both."""

    def __init__(self, out: Path, start_step: int, last_step: int):
        from torch.utils.tensorboard import SummaryWriter
        from tqdm import tqdm

        self.writer = SummaryWriter(log_dir=str(Path(out) / TB_DIR))
        # disable=None: a bar on a terminal, nothing in a log file
        self.bar = tqdm(total=last_step, initial=start_step, desc="dreamzero-train", unit="step", disable=None)
        self.bar_shown = not self.bar.disable

    def write(self, record: dict) -> None:
        for key in SCALARS:
            if key in record:
                self.writer.add_scalar(f"train/{key}", record[key], record["step"])
        self.writer.flush()

    def advance(self, record: dict) -> None:
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{record['loss']:.4f}", samples_s=f"{record.get('samples_per_s', 0):.2f}")

    def close(self) -> None:
        self.bar.close()
        self.writer.close()

    def __enter__(self) -> RunLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_scalars(out: str | Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} from a run's event files (tensorboard's own reader)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(Path(out) / TB_DIR))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
