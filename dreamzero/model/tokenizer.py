"""The T5 tokenizer: loading a local `google/umt5-xxl` copy, or building a small deterministic one in code.

Released DreamZero checkpoints ship no tokenizer; they were trained with `google/umt5-xxl`, which a user downloads
once. The embedded default model uses `build_local_tokenizer`: a Unigram vocabulary written out in code (no training,
no download), saved as `tokenizer.json` and wrapped as a `transformers.PreTrainedTokenizerFast`, so the same loading
path serves both.
"""

from __future__ import annotations

import html
import os
import re
import string
from pathlib import Path

from dreamzero.errors import CheckpointError

#: where real checkpoints' tokenizer comes from (named in every "not found" message)
UMT5_TOKENIZER_REPO = "google/umt5-xxl"
#: environment variable naming a local tokenizer directory (used when neither an argument nor the config names one)
TOKENIZER_ENV = "DREAMZERO_TOKENIZER_PATH"

# T5 convention: pad 0, eos 1, unk 2 (the text encoder pads with id 0 and the model never attends to padding)
_SPECIALS = ("<pad>", "</s>", "<unk>")
# Words a robot instruction is made of, then those of the default negative prompt (every guided row carries it); each
# becomes one whole-word piece so prompts tokenise into few ids (the DiT's cross-attention cost follows the longest).
_WORDS = (
    "the a an and of to in on into onto from with up down left right top bottom front back side open close put "
    "pick place move push pull turn take lift drop grasp hold stack slide rotate press insert remove cup bowl plate "
    "box block drawer door lid cabinet table shelf basket bottle can marker pen towel sponge spoon fork knife mug "
    "pot pan red green blue yellow black white orange purple small large it them then robot arm gripper object "
    "Vibrant colors overexposed static blurry details text subtitles style artwork painting image still grayscale "
    "dull worst quality low JPEG artifacts ugly mutilated extra fingers bad hands face deformed disfigured mutated "
    "limbs fused stagnant cluttered background three legs many people walking backwards"
).split()


def clean_prompt(text: str) -> str:
    """Whitespace clean-up applied before tokenising (as the Wan text encoder does): unescape, collapse spaces."""
    return re.sub(r"\s+", " ", html.unescape(html.unescape(text))).strip()


def build_local_tokenizer(vocab_size: int):
    """A deterministic Unigram tokenizer with exactly `vocab_size` pieces, wrapped as PreTrainedTokenizerFast.

    Pieces: the 3 specials, the word-start marker, printable ASCII characters (with and without the marker),
    common instruction words, then lowercase letter pairs until the vocabulary is full. Every piece scores -1, so
    the Viterbi segmentation picks the fewest pieces (longest matches). Appends `</s>` like the T5 tokenizer.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    marker = "\u2581"  # sentencepiece's word-start marker
    chars = [c for c in string.printable if not c.isspace()]
    pieces: list[str] = list(_SPECIALS) + [marker]
    pieces += [marker + c for c in chars] + chars
    pieces += [marker + w for w in _WORDS]
    pairs = (a + b for a in string.ascii_lowercase for b in string.ascii_lowercase)
    seen = set(pieces)
    for pair in pairs:
        if len(pieces) >= vocab_size:
            break
        if pair not in seen:
            pieces.append(pair)
            seen.add(pair)
    minimum = len(_SPECIALS) + 1 + 2 * len(chars)
    if vocab_size < minimum:
        raise ValueError(f"text_encoder.vocab_size must be >= {minimum} for the local tokenizer, got {vocab_size}")
    pieces = pieces[:vocab_size]

    tok = Tokenizer(models.Unigram([(p, -1.0) for p in pieces], unk_id=_SPECIALS.index("<unk>")))
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=marker, prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement=marker, prepend_scheme="always")
    eos_id = _SPECIALS.index("</s>")
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", eos_id)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def resolve_tokenizer_path(
    explicit: str | os.PathLike | None, configured: str | None, model_dir: str | os.PathLike | None
) -> Path:
    """Pick the tokenizer directory: argument > config > `<model_dir>/tokenizer` > $DREAMZERO_TOKENIZER_PATH.

    Fails with a message that says what to download when none of them exists.
    """
    candidates: list[tuple[str, Path]] = []
    if explicit:
        candidates.append(("tokenizer_path argument", Path(explicit)))
    if configured:
        candidates.append(("text_encoder.tokenizer_path in the config", Path(configured)))
    if model_dir is not None:
        candidates.append(("the checkpoint's tokenizer/ folder", Path(model_dir) / "tokenizer"))
    if os.environ.get(TOKENIZER_ENV):
        candidates.append((f"${TOKENIZER_ENV}", Path(os.environ[TOKENIZER_ENV])))
    for source, path in candidates:
        if path.is_dir():
            return path
        if source != "the checkpoint's tokenizer/ folder":
            # an explicitly named path that does not exist is a mistake worth reporting as such
            raise CheckpointError(f"tokenizer directory {str(path)!r} (from the {source}) does not exist")
    raise CheckpointError(
        "no tokenizer found: DreamZero checkpoints do not ship one. Download the "
        f"{UMT5_TOKENIZER_REPO!r} tokenizer once (e.g. `huggingface-cli download {UMT5_TOKENIZER_REPO} "
        "--include 'tokenizer*' 'special_tokens_map.json' 'spiece.model' --local-dir /path/umt5-xxl`) and pass "
        f"tokenizer_path=/path/umt5-xxl, set ${TOKENIZER_ENV}, or copy it to <checkpoint>/tokenizer/"
    )


def load_tokenizer(path: str | os.PathLike):
    """Load a tokenizer from a local directory only (never the network)."""
    from transformers import AutoTokenizer

    path = Path(path)
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"cannot load a tokenizer from {str(path)!r} ({exc}); expected a local copy of {UMT5_TOKENIZER_REPO!r} "
            "(tokenizer.json or spiece.model + tokenizer_config.json)"
        ) from exc
