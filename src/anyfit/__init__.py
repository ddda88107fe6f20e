"""anyfit: SFT that adapts to the hardware."""
__version__ = "0.1.0"
