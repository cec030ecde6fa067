"""Preprocess deployment (CPU): raw environment observations -> `ModelBatch` + the context postprocess needs; and the
normalised form (RLinf), which maps onto a `ModelBatch` as it is.

A thin adapter around the embodiment's transforms (crop, resize, stitch, q99 state, prompt template), which are pure
functions of the request plus the statistics, so replicas scale independently of the model. The statistics arrive as
data (read once by `build_app`, serve_graph/model_source.py): this process never opens the checkpoint.
"""

from __future__ import annotations

from deployments.config.settings import EmbodimentSettings, StageSettings
from deployments.requests.generations import GenerationRequest
from dreamzero.embodiments import Embodiment, PostprocessContext, get_embodiment
from dreamzero.errors import InvalidRequest
from dreamzero.types import ModelBatch
from dreamzero_client.wire.openpi import OPENPI_DROID_KEY_MAP


def load_embodiment(source: EmbodimentSettings | str = "oxe_droid") -> Embodiment:
    """The embodiment with the statistics `build_app` read ({tag: entry}); a bare tag or no metadata: the shipped
    synthetic file."""
    if isinstance(source, str):
        source = EmbodimentSettings(tag=source)
    return get_embodiment(source.tag, source.metadata)


def openpi_key_map(embodiment: Embodiment) -> dict[str, str]:
    """OpenPI wire key -> the embodiment's raw key (DROID's map when the embodiment declares none)."""
    return dict(getattr(embodiment, "openpi_key_map", None) or OPENPI_DROID_KEY_MAP)


def preprocess_request(embodiment: Embodiment, request: GenerationRequest) -> tuple[ModelBatch, PostprocessContext]:
    """A raw request -> (the policy's ModelBatch, what postprocess needs); where it runs: deployments/stages.py."""
    if request.form != "raw":
        raise InvalidRequest("preprocess handles the raw form only; normalised requests go to the policy")
    # JSON pixel lists (int64) are accepted by the embodiment's own image parser
    inputs, context = embodiment.preprocess(request.observation, list(request.prompts), batched=True)
    if len(inputs) != request.batch_size:
        raise InvalidRequest(
            f"input.observation holds {len(inputs)} rows but parameters.session_ids has {request.batch_size}"
        )
    # the rows' options as sent: an action prefix in robot units, which the batch's action codec brings to the model's
    batch = request.rows.to_batch(inputs.to_model_batch(list(request.session_ids)))
    return batch, context


def normalised_batch(request: GenerationRequest) -> ModelBatch:
    """A normalised-form request as it is (prompts are used as sent: RLinf formats them itself)."""
    if request.form != "normalised":
        raise InvalidRequest("only a normalised-form request maps directly onto a ModelBatch; run preprocess")
    obs = request.observation
    emb = obs.get("embodiment_id")
    batch = ModelBatch(
        images=obs["images"],
        state=obs["state"],
        state_mask=obs["state_mask"],
        prompts=list(request.prompts),
        session_ids=list(request.session_ids),
        embodiment_id=None if emb is None else [int(x) for x in emb],
        routing_key=request.route_key,
    )
    return request.rows.to_batch(batch)  # an action prefix in normalised units: this form has no action codec


class PreprocessDeployment:
    def __init__(self, settings: StageSettings | None = None):
        self.embodiment = load_embodiment((settings or StageSettings()).embodiment)
        self.embodiment.warm_up()  # compile the image kernel here, not on the first request

    def run(self, request: GenerationRequest) -> tuple[ModelBatch, PostprocessContext]:
        return preprocess_request(self.embodiment, request)

    def ready(self) -> bool:
        return True
