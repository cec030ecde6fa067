"""The Franka loop's policy: the client runtime's `DroidPolicy` (shared with the sim evaluation) over a URL.

Everything DROID-specific (observation builder, frame history, chunk check, gripper rule, session continuity) lives
in `dreamzero_client.droid` / `dreamzero_client.policy`; the robot adds only its session prefix and the minimum
number of rows a chunk needs for the loop's open-loop horizon.
"""

from __future__ import annotations

from dreamzero_client.links import OpenPILink, connect
from dreamzero_client.policy import Chunk, ChunkRejected, DroidPolicy, PolicyCallError

__all__ = ["Chunk", "ChunkRejected", "DroidPolicy", "PolicyCallError", "connect_policy"]


def connect_policy(
    url: str, prompt: str, api_key: str | None = None, timeout_s: float = 30.0, max_reconnects: int = 1
) -> DroidPolicy:
    """A DroidPolicy for `url`: ws:// / wss:// -> the OpenPI WebSocket; http:// / https:// -> the HTTP endpoint.

    A WebSocket server is connected to (and its handshake read) here, so a wrong URL fails before the arm moves.
    """
    link = connect(url, api_key=api_key, timeout_s=timeout_s, max_reconnects=max_reconnects, field="--server")
    policy = DroidPolicy(link, prompt=prompt, session_prefix="franka")
    if isinstance(link, OpenPILink):
        link.open()
    return policy
