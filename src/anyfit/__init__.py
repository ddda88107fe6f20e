"""anyfit: SFT that adapts to the hardware."""
import logging

__version__ = "0.1.0"


class _TorchaoEnumNotice(logging.Filter):
    """Drops the two lines torch logs when torchao 0.18 registers its Enums as pytree constants (deprecated, still
    working). peft imports torchao whenever it is installed, so without this every run would print them; nothing
    the user can act on. Only that message of that one logger is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "is an Enum subclass and is now natively supported" not in str(record.msg)


# torch's own logger name (torch/utils/_pytree.py); torch need not be imported yet for this to hold
logging.getLogger("torch.utils._pytree").addFilter(_TorchaoEnumNotice())
