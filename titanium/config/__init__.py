"""Job configuration: one dataclass per TOML section, loaded from defaults < TOML < CLI."""

from titanium.config.loader import ConfigError, load_config, to_toml_dict
from titanium.config.sections import JobConfig

__all__ = ["ConfigError", "JobConfig", "load_config", "to_toml_dict"]
