"""flowrl configuration: one dataclass per component (`sections.py`), loaded from YAML plus dotted
`key=value` overrides (`loading.py`). Import everything from here: `from flowrl.config import
load_config, RolloutConfig`.
"""

from flowrl.config.loading import config_from_dict, config_to_dict, config_to_yaml, load_config
from flowrl.config.sections import *  # noqa: F401,F403
from flowrl.config.sections import (
    AlgorithmConfig,
    DataConfig,
    DistributedConfig,
    EngineConfig,
    FlowRLConfig,
    LoggingConfig,
    LoraConfig,
    ModelConfig,
    RewardConfig,
    RolloutConfig,
    TrainerConfig,
)

__all__ = [
    "AlgorithmConfig",
    "DataConfig",
    "DistributedConfig",
    "EngineConfig",
    "FlowRLConfig",
    "LoggingConfig",
    "LoraConfig",
    "ModelConfig",
    "RewardConfig",
    "RolloutConfig",
    "TrainerConfig",
    "config_from_dict",
    "config_to_dict",
    "config_to_yaml",
    "load_config",
]
