"""The typed run config (run.yaml): pydantic sections, loading, overrides, and every cross-field rule.

from mopd_hpc.config import load_run_config, RunConfig, ConfigError
cfg = load_run_config("configs/local_cpu.yaml", overrides=["steps=3"], force_local=True)
"""

from __future__ import annotations

from mopd_hpc.config.base import Section
from mopd_hpc.config.cluster import ClusterConfig, GroupConfig
from mopd_hpc.config.data import DataConfig, EvalConfig, JsonlSource, ReasoningGymSource, SourceConfig
from mopd_hpc.config.loader import load_run_config
from mopd_hpc.config.loss import LossConfig
from mopd_hpc.config.models import ActorConfig, ModelsConfig, OptimizerConfig, TeacherConfig, TokenizerConfig
from mopd_hpc.config.overrides import apply_overrides
from mopd_hpc.config.problems import ConfigError, Problem
from mopd_hpc.config.rollout import RolloutConfig, RolloutEnginesConfig, SamplingConfig, WeightSyncConfig
from mopd_hpc.config.run import RunConfig

__all__ = [
    "ActorConfig",
    "ClusterConfig",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "GroupConfig",
    "JsonlSource",
    "LossConfig",
    "ModelsConfig",
    "OptimizerConfig",
    "Problem",
    "ReasoningGymSource",
    "RolloutConfig",
    "RolloutEnginesConfig",
    "RunConfig",
    "SamplingConfig",
    "Section",
    "SourceConfig",
    "TeacherConfig",
    "TokenizerConfig",
    "WeightSyncConfig",
    "apply_overrides",
    "load_run_config",
]
