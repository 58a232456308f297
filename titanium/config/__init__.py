"""Job configuration: one dataclass per TOML section, loaded from defaults < TOML < CLI; components register
their sections (titanium/config/components.py)."""

from titanium.config.components import JobConfig
from titanium.config.errors import ConfigError
from titanium.config.loader import load_config, to_toml_dict

__all__ = ["ConfigError", "JobConfig", "load_config", "to_toml_dict"]
