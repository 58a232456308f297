"""titanium: a PyTorch-native library for training large language models."""

import logging


class _Unactionable(logging.Filter):
    """Drops library log lines that say nothing a titanium user can act on: torchao naming each optional kernel
    library it cannot load on this machine (CUDA builds on a CPU, other Python versions), and torch deprecating
    torchao's registration of its enums for pytree. Everything else those loggers say passes."""

    def __init__(self, *starts: str, contains: str = "") -> None:
        super().__init__()
        self.starts, self.contains = starts, contains

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith(self.starts) and self.contains in message)


logging.getLogger("torchao").addFilter(_Unactionable("Failed to load ", contains=".so"))
logging.getLogger("torch.utils._pytree").addFilter(
    _Unactionable("<enum ", contains="is an Enum subclass and is now natively supported")
)
