"""Dataset sources (reasoning-gym tasks, users' jsonl files), prompt formatting and templates, and rewards.

Light to import: reasoning-gym is imported on first use; `mopd_hpc.data.tokenizer` and
`mopd_hpc.data.evaluation` (transformers, torch) are imported explicitly by who needs them.
"""

from __future__ import annotations

from mopd_hpc.data.errors import (
    DataSourceError,
    JsonlFormatError,
    PromptRecordError,
    RewardError,
    SourceIndexError,
)
from mopd_hpc.data.formatting import PROMPT_FORMATTERS, format_prompt
from mopd_hpc.data.prompt import SOURCE_KINDS, Prompt
from mopd_hpc.data.rewards import CORRECT_REWARD, extract_answer, is_correct, score_completion
from mopd_hpc.data.scoring import Scoring
from mopd_hpc.data.sources import (
    DEFAULT_SIZE,
    EVAL_SEED_OFFSET,
    SPLIT_SPAN,
    SPLITS,
    JsonlSource,
    PromptSource,
    ReasoningGymSource,
    make_source,
)

__all__ = [
    "CORRECT_REWARD",
    "DEFAULT_SIZE",
    "EVAL_SEED_OFFSET",
    "PROMPT_FORMATTERS",
    "SOURCE_KINDS",
    "SPLITS",
    "SPLIT_SPAN",
    "DataSourceError",
    "JsonlFormatError",
    "JsonlSource",
    "Prompt",
    "PromptRecordError",
    "PromptSource",
    "ReasoningGymSource",
    "RewardError",
    "Scoring",
    "SourceIndexError",
    "extract_answer",
    "format_prompt",
    "is_correct",
    "make_source",
    "score_completion",
]
