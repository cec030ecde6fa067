"""`dreamzero-eval-libero` (also `python -m eval.libero`): evaluate a policy server on a LIBERO suite, RLinf style.

B environments step together and send one B-row request per 16-action chunk; an episode counts as a success the
first time its task succeeds. Shard a suite over machines with --tasks and --init-states (docs/libero.md). Writes
videos, per-episode JSON, summary.json / summary.md and report.html under --out.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from dreamzero.cli_help import DefaultsHelpFormatter
from dreamzero.errors import ConfigError, MissingDependency
from eval.libero.adapter import FORMS
from eval.libero.env import DEFAULT_RESOLUTION, SUITE_MAX_STEPS


def parse_index_ranges(text: str, name: str) -> tuple[int, ...] | None:
    """'all' -> None; '0-4,7' -> (0, 1, 2, 3, 4, 7) (inclusive ranges, in the order given, duplicates dropped)."""
    if text.strip().lower() == "all":
        return None
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        try:
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                if hi < lo:
                    raise ValueError
                values = range(lo, hi + 1)
            else:
                values = [int(part)]
        except ValueError:
            raise ConfigError(f"--{name}: expected 'all' or indexes like '0-4,7', got {text!r}") from None
        if min(values) < 0:
            raise ConfigError(f"--{name}: indexes must be >= 0, got {text!r}")
        out += [v for v in values if v not in out]
    return tuple(out)


def add_libero_arguments(p: argparse.ArgumentParser) -> None:
    """The LIBERO options. Options the parser already has (`dreamzero-eval`'s --max-steps, --seed, ...) are kept as
    they are, so `dreamzero-eval` can add these to its own parser for `--sim libero`."""
    g = p.add_argument_group("LIBERO")

    def add(*names: str, **kw) -> None:
        if not any(n in p._option_string_actions for n in names):  # argparse has no public lookup
            g.add_argument(*names, **kw)

    add("--suite", default="libero_spatial", help=f"task suite ({', '.join(SUITE_MAX_STEPS)})")
    add("--tasks", default="all", help="task ids, e.g. '0-4' or '2,7' (shard a suite by tasks)")
    add("--init-states", default="all", help="init-state indexes per task, e.g. '0-24' (shard by states)")
    add("--num-envs", type=int, default=8, help="B: environments stepped together, rows per request")
    add("--form", choices=FORMS, default="raw", help="request form: raw libero_sim keys or RLinf-normalised")
    add("--metadata", default=None, help="libero_sim statistics for --form normalised (file or ckpt dir)")
    add("--frames", type=int, choices=(1, 4), default=None, help="frames per row (default: 4 raw, 1 normalised)")
    add("--action-chunk", type=int, default=16, help="actions executed open loop per request")
    add("--max-steps", type=int, default=None, help="step limit per episode (default: the suite's)")
    add("--settle-steps", type=int, default=10, help="still steps after reset (objects settle)")
    add("--resolution", type=int, default=DEFAULT_RESOLUTION, help="camera height = width")
    add("--step-timeout-s", type=float, default=60.0, help="bound on one step of all envs")
    add("--reset-timeout-s", type=float, default=600.0, help="bound on starting episodes (env creation)")
    add("--max-retries", type=int, default=2, help="retries of a failed request")
    add("--ready-timeout-s", type=float, default=300.0, help="wait this long for the server's /health first")
    add("--predicted-video", action="store_true", help="imagined vs real per episode (docs/evaluation.md)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dreamzero-eval-libero", description=__doc__, formatter_class=DefaultsHelpFormatter
    )
    add_libero_arguments(p)
    g = p.add_argument_group("policy server (HTTP)")
    g.add_argument("--url", default=None, help="base URL, http:// or https:// (default http://HOST:PORT)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None)
    g.add_argument(
        "--ca-bundle",
        default=None,
        metavar="PATH",
        help="PEM of the CA certificate(s) an https:// server's certificate must chain to (default: the system "
        "trust store)",
    )
    g.add_argument("--timeout-s", type=float, default=300.0, help="per-request timeout")
    g.add_argument("--seed", type=int, default=0, help="base of the per-row request seeds")
    g = p.add_argument_group("outputs")
    g.add_argument("--out", type=Path, default=None, help="run directory (default runs/libero-eval-<time>)")
    g.add_argument("--no-video", action="store_true")
    g.add_argument("--no-report", action="store_true")
    g.add_argument(
        "--no-progress", action="store_true", help="no progress (a bar on a terminal, a plain line every 30 s in a log)"
    )
    return p


def config_from_args(ns: argparse.Namespace):
    from eval.libero.runner import LiberoEvalConfig

    if ns.resolution < 32:
        raise ConfigError(f"--resolution: expected >= 32, got {ns.resolution}")
    out = ns.out if ns.out is not None else Path("runs") / time.strftime("libero-eval-%Y%m%d-%H%M%S")
    config = LiberoEvalConfig(
        out_dir=Path(out),
        suite=ns.suite,
        task_ids=parse_index_ranges(ns.tasks, "tasks"),
        init_states=parse_index_ranges(ns.init_states, "init-states"),
        num_envs=ns.num_envs,
        form=ns.form,
        action_chunk=ns.action_chunk,
        frame_stack=ns.frames,
        max_steps=ns.max_steps,
        settle_steps=ns.settle_steps,
        step_timeout_s=ns.step_timeout_s,
        reset_timeout_s=ns.reset_timeout_s,
        request_timeout_s=ns.timeout_s,
        seed=ns.seed,
        record_video=not ns.no_video,
        predicted_video=ns.predicted_video,
        extra={"simulator": "libero", "benchmark": "LIBERO", "suite": ns.suite, "form": ns.form},
    )
    config.validate()
    _ = config.step_limit  # an unknown suite without --max-steps fails here, before the wait for the server
    return config


def run_from_args(ns: argparse.Namespace) -> int:
    """Everything after parsing; `dreamzero-eval --sim libero` can call this with its own namespace."""
    from dreamzero_client.errors import ClientError
    from dreamzero_client.http_client import ActionClient
    from dreamzero_client.tls import check_scheme, client_context
    from eval.libero.env import LiberoBackend
    from eval.libero.runner import run_libero_evaluation
    from eval.summary import summary_markdown

    try:
        config = config_from_args(ns)
        url = ns.url or f"http://{ns.host}:{ns.port}"
        if ns.ca_bundle is not None:  # checked here so the message names the options
            check_scheme(url.split("://", 1)[0], ns.ca_bundle, f"--ca-bundle with --url {url}")
            client_context(ns.ca_bundle, field="--ca-bundle")
        client = ActionClient(
            url, api_key=ns.api_key, timeout_s=ns.timeout_s, max_retries=ns.max_retries, ca_bundle=ns.ca_bundle
        )
        backend = LiberoBackend(ns.suite, resolution=ns.resolution, seed=ns.seed)
    except (ConfigError, MissingDependency, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        print(f"waiting up to {ns.ready_timeout_s:g} s for {url}/health (--ready-timeout-s)", file=sys.stderr)
        client.wait_until_ready(timeout_s=ns.ready_timeout_s)
        summary = run_libero_evaluation(backend, client, config, ns.metadata, show_progress=not ns.no_progress)
    except (ConfigError, MissingDependency, ValueError, ClientError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        client.close()
    print(summary_markdown(summary))
    if not ns.no_report:
        from eval.report import write_report

        print(f"report: {write_report(config.out_dir)}")
    print(f"outputs: {config.out_dir}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_from_args(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
