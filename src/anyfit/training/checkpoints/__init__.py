"""A run's checkpoints and where a run starts: writing them (``checkpoint``: the ``Checkpointer`` and its cadence,
the final model), checking them (``integrity``: manifests, ``train.resume`` resolved), the disk they go to
(``disk``: room, failed writes agreed by every process), and where a run starts and whether it may (``start``:
fresh, resumed, restarted, another layout). The model and optimizer states themselves are the backend's
(``anyfit.backends``)."""
