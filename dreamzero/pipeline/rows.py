"""The session decisions of one call: find or create each row's session and decide whether (and why) it restarts.

Restart reasons, first match wins: `new_session` / `evicted` (the store has no state), `reset_requested`,
`step_mismatch` (expected step or incarnation differs), `prompt_changed`, `single_frame` (1-frame input after the
first call), `window_full`. A restarted session keeps the T5 rows of an unchanged prompt and, across restarts that
do not stop the robot, its last chunk (`rtc.carried_chunk`).
"""

from __future__ import annotations

from dataclasses import dataclass

from dreamzero import rtc
from dreamzero.embodiments.transforms import NEGATIVE_PROMPT as DEFAULT_NEGATIVE_PROMPT
from dreamzero.sessions import SessionState, SessionStore
from dreamzero.types import ModelBatch


@dataclass
class Row:
    """One batch row in a call: its index in the batch, its session, whether (and why) it restarts, its seed."""

    index: int
    state: SessionState
    restarted: bool
    reason: str | None
    seed: int


def resolve_rows(
    batch: ModelBatch,
    store: SessionStore,
    max_attention_frames: int,
    default_seed: int,
    decided: list[str | None] | None = None,
) -> list[Row]:
    """Find or create each row's session and decide whether (and why) it restarts.

    `decided` (a CFG-parallel rank 1): each row's reason as rank 0 decided it (None: continue); a row whose state
    this store lacks restarts whatever was decided (`cfg_parallel.BranchGroup.agree_rows` then restarts it on both).
    """
    single_frame = batch.images.shape[1] == 1
    rows = []
    for i, sid in enumerate(batch.session_ids):
        prompt = batch.prompts[i]
        negative = batch.negative_prompts[i] if batch.negative_prompts else DEFAULT_NEGATIVE_PROMPT
        state, reason = store.lookup(sid)
        expected = batch.expected_steps[i] if batch.expected_steps else None
        expected_inc = batch.expected_incarnations[i] if batch.expected_incarnations else None
        if state is None:
            pass  # reason is "new_session" or "evicted"
        elif decided is not None:
            reason = decided[i]
        elif (batch.reset_mask and batch.reset_mask[i]) or state.reset_pending:
            reason = "reset_requested"
        elif (expected is not None and int(expected) != state.step) or (
            expected_inc is not None and expected_inc != state.incarnation
        ):
            reason = "step_mismatch"
        elif prompt != state.prompt or negative != state.negative_prompt:
            reason = "prompt_changed"
        elif single_frame:
            reason = "single_frame"
        elif state.current_start_frame >= max_attention_frames:
            reason = "window_full"
        if reason is not None:
            state = restarted_state(state, sid, prompt, negative, reason)
        seed = int(batch.seeds[i]) if batch.seeds is not None else default_seed
        rows.append(Row(index=i, state=state, restarted=reason is not None, reason=reason, seed=seed))
    return rows


def restarted_state(state: SessionState | None, sid: str, prompt: str, negative: str, reason: str) -> SessionState:
    """A fresh state for a restarting session: the T5 rows of an unchanged prompt and the carried chunk survive."""
    old_text = state.text_cache if state is not None else {}
    keep = {}
    if state is not None and state.prompt == prompt and "cond" in old_text:
        keep["cond"] = old_text["cond"]
    if state is not None and state.negative_prompt == negative and "uncond" in old_text:
        keep["uncond"] = old_text["uncond"]
    prev_chunk = rtc.carried_chunk(state, reason)  # the robot's motion outlives some model restarts
    if state is not None:
        state.release_tensors()  # the old caches go before the new ones come: never two footprints
    return SessionState(session_id=sid, prompt=prompt, negative_prompt=negative, text_cache=keep, prev_chunk=prev_chunk)
