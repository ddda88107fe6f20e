"""Where a training step's time and memory go, and what to change: model FLOPs utilisation (``flops``), the
trace read as phases (``trace``), memory by kind (``memory``), the rules from measurements to config keys
(``advice``, ``facts``), the profiler around the loop (``session``) and the printed report (``report``).

Below ``anyfit.training``: the loop calls into it (``runtime.profile``, MFU on every metrics line); it never
imports the loop.
"""
