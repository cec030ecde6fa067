"""How the evaluation reaches a policy: the client runtime's `DroidPolicy` over one of three links.

The runner only talks to `dreamzero_droid.policy.DroidPolicy` (observe / infer / reset / close), which owns the
DROID client logic shared with the Franka loop: frame history, observation builder, chunk check, session continuity.
What differs is the link: the OpenPI WebSocket and the HTTP action endpoint live in `dreamzero_droid.links`; the
in-process embedded policy (no server, needs the model core) is `EmbeddedLink` below.
"""

from __future__ import annotations

from dreamzero.errors import ConfigError
from dreamzero_droid import droid
from dreamzero_droid.links import HttpLink, OpenPILink
from dreamzero_droid.policy import DroidPolicy, LinkReply, PolicyCallError, Query

LINKS = ("openpi", "http", "embedded")


class EmbeddedLink:
    """Runs `dreamzero.policy.EmbeddedPolicy` in this process (the tiny random model when no path is given)."""

    name = "embedded"
    return_video = False  # set True to ask for the predicted frames with every chunk (LinkReply.video)

    def __init__(self, model_path: str | None = None, embodiment: str = "oxe_droid", policy=None):
        if policy is None:
            from dreamzero.embedded_default import resolve_model_path
            from dreamzero.policy import EmbeddedPolicy

            policy = EmbeddedPolicy.load(model_path=resolve_model_path(model_path), embodiment=embodiment)
        self._policy = policy

    def send(self, query: Query) -> LinkReply:
        rtc = query.rtc  # real-time chunking: the same per-row fields as the HTTP body (docs/rtc.md)
        rtc_kwargs = {} if rtc is None else {"rtc_prefix_len": [rtc.prefix_len], "rtc_exec_horizon": [rtc.exec_horizon]}
        if rtc is not None and rtc.action_prefix is not None:
            rtc_kwargs["action_prefix"] = [rtc.action_prefix]
        try:
            result = self._policy.infer(
                droid.raw_observation(query.frames),
                [query.session_id],
                instructions=[query.prompt],
                expected_steps=None if query.first_call else [query.expected_step],
                **rtc_kwargs,
                **({"return_video": True} if self.return_video else {}),
            )
        except Exception as exc:  # in process there is no transport: every failure is the policy's answer
            raise PolicyCallError("error_reply", f"{type(exc).__name__}: {exc}") from exc
        sessions = getattr(result, "sessions", None) or [None]
        session = sessions[0].to_dict() if hasattr(sessions[0], "to_dict") else sessions[0]
        video = getattr(result, "video", None)
        return LinkReply(result.actions, session, dict(getattr(result, "timings_ms", None) or {}), video)

    def reset(self, session_id: str) -> None:
        self._policy.reset([session_id])

    def close(self) -> None:
        close = getattr(self._policy, "close", None)
        if callable(close):
            close()


def make_policy(kind: str, session_prefix: str = "droid-eval", **link_kwargs) -> DroidPolicy:
    """`kind` in LINKS; `link_kwargs` go to the link's constructor. The prompt comes with every observation."""
    classes = {"openpi": OpenPILink, "http": HttpLink, "embedded": EmbeddedLink}
    if kind not in classes:
        raise ConfigError(f"policy: expected one of {LINKS}, got {kind!r}")
    return DroidPolicy(classes[kind](**link_kwargs), session_prefix=session_prefix)
