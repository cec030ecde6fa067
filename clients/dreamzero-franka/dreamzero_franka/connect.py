"""The Franka loop's policy over a URL: `DroidPolicy` (oxe_droid) or `PnpPolicy` (franka_pnp), chosen by the server.

Everything DROID-specific (observation builder, frame history, chunk check, gripper rule, session continuity) lives
in `dreamzero_droid.droid` / `dreamzero_droid.policy`; franka_pnp's counterpart is `pnp.policy`; both policies build
on `SessionPolicy`.

Which embodiment a server runs: the HTTP metadata (`GET /v1/actions/metadata`) names it (`embodiment`); the OpenPI
handshake names it only for franka_pnp (`embodiment: franka_pnp`, since its `action_space: eef_delta` with one exterior
view is also LIBERO's); a handshake without the key but with `action_space: joint_position` is DROID's (what
DreamZero's oxe_droid server and OpenPI's DROID servers send). Anything else needs `--embodiment`.
"""

from __future__ import annotations

from dreamzero_client.errors import ConfigError, InvalidObservation
from dreamzero_droid.links import OpenPILink, connect
from dreamzero_droid.policy import Chunk, ChunkRejected, DroidPolicy, PolicyCallError, as_call_error
from dreamzero_franka.pnp.policy import PnpHttpLink, PnpOpenPILink, PnpPolicy

__all__ = [
    "EMBODIMENTS",
    "Chunk",
    "ChunkRejected",
    "DroidPolicy",
    "PnpPolicy",
    "PolicyCallError",
    "advertised_embodiment",
    "connect_policy",
]

EMBODIMENTS = ("oxe_droid", "franka_pnp")


def advertised_embodiment(link) -> tuple[str | None, str]:
    """(embodiment tag or None, what the server said) from the OpenPI handshake or the HTTP metadata."""
    if isinstance(link, OpenPILink):
        cfg = link.open()
        tag = cfg.get("embodiment")
        if isinstance(tag, str):
            return tag, f"handshake embodiment={tag!r}"
        space = cfg.get("action_space")
        if space == "joint_position":
            return "oxe_droid", "handshake action_space='joint_position' (DROID's)"
        return None, f"the handshake names no embodiment (action_space={space!r})"
    try:
        meta = link.client.metadata()
    except Exception as exc:
        raise as_call_error(exc) from exc
    tag = meta.get("embodiment") if isinstance(meta, dict) else None
    if isinstance(tag, str):
        return tag, f"/v1/actions/metadata embodiment={tag!r}"
    return None, "/v1/actions/metadata names no embodiment"


def connect_policy(
    url: str,
    prompt: str,
    api_key: str | None = None,
    timeout_s: float = 30.0,
    max_reconnects: int = 1,
    embodiment: str | None = "oxe_droid",
    ca_bundle: str | None = None,
) -> DroidPolicy | PnpPolicy:
    """The policy for `url` (ws:// / wss:// -> OpenPI WebSocket; http:// / https:// -> the HTTP endpoint; `ca_bundle`:
    the CA certificate(s) a TLS server's must chain to, default the system trust store).

    `embodiment`: "oxe_droid" / "franka_pnp" to insist on one (a server advertising another is an error), None to
    take the server's. The server is contacted here (handshake or metadata), so a wrong URL or a mismatched server
    fails before the arm moves.
    """
    if embodiment is not None and embodiment not in EMBODIMENTS:
        raise ConfigError(f"--embodiment must be one of {EMBODIMENTS} (or auto), got {embodiment!r}")
    if not isinstance(prompt, str) or not prompt.strip():
        raise InvalidObservation("prompt: expected a non-empty instruction", field="prompt")
    probe = connect(
        url, api_key=api_key, timeout_s=timeout_s, max_reconnects=max_reconnects, field="--server", ca_bundle=ca_bundle
    )
    tag, said = None, "not asked"
    if isinstance(probe, OpenPILink) or embodiment is None:  # HTTP with a chosen embodiment: checked on first query
        try:
            tag, said = advertised_embodiment(probe)
        except BaseException:
            probe.close()
            raise
    if tag is not None and embodiment is not None and tag != embodiment:
        probe.close()
        raise ConfigError(f"--embodiment {embodiment} but the server runs {tag} ({said})")
    chosen = embodiment or tag
    if chosen not in EMBODIMENTS:
        probe.close()
        what = f"runs {tag!r}, which this client does not drive" if tag else "does not say which embodiment it runs"
        raise ConfigError(f"--server {what} ({said}); pass --embodiment {' or '.join(EMBODIMENTS)}")
    if chosen == "oxe_droid":
        return DroidPolicy(probe, prompt=prompt, session_prefix="franka")
    if isinstance(probe, OpenPILink):  # the probe was DROID's link; franka_pnp's sends its own message
        probe.close()
        link = PnpOpenPILink(
            url, api_key=api_key, timeout_s=timeout_s, max_reconnects=max_reconnects, ca_bundle=ca_bundle
        )
        link.open()
    else:
        link = PnpHttpLink(url, client=probe.client)
    return PnpPolicy(link, prompt=prompt, session_prefix="franka-pnp")
