"""Units written once: a size in bytes divided by ``GIB`` is GiB, the unit memory is reported and budgeted in
everywhere (the planner, the metrics line, the memory probe, storage messages). Standard library only."""

GIB = 2**30
