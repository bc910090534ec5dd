"""mtpspec: lossless speculative decoding built around multi-token prediction."""

from .api import Model, load
from .config import GenerationConfig
from .engine import Engine, Session
from .errors import ConfigError, ModelLoadError, MtpspecError
from .grammar import Grammar
from .prefix import PrefixStore
from .sampling import SamplingParams
from .types import Draft, GenerationResult, GenerationStats, StepRecord, TargetOutput, Verdict

__version__ = "0.1.0"

__all__ = [
    "load", "Model", "GenerationConfig", "Engine", "Session", "SamplingParams", "GenerationResult", "GenerationStats", "StepRecord",
    "Draft", "Verdict", "TargetOutput", "MtpspecError", "ModelLoadError", "ConfigError", "Grammar",
    "PrefixStore",
]
