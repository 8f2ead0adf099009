"""The EAGLE-3 draft head: config, parameters, forward pieces, training-time test, export."""

from eagle3_jax.draft.config import DraftConfig
from eagle3_jax.draft.params import DraftHead, VocabMap, draft_param_specs, init_draft_params
from eagle3_jax.draft.ttt import TTTBatch, ttt_forward

__all__ = ["DraftConfig", "DraftHead", "TTTBatch", "VocabMap", "draft_param_specs",
           "init_draft_params", "ttt_forward"]
