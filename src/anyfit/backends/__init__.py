"""How a run is spread over its processes: replicated (DDP), sharded by FSDP2, or partitioned by DeepSpeed ZeRO-3,
behind one interface (``Backend``) chosen once per run (``choose_backend``).

A checkpoint on any layout: written by N processes, sharded or replicated, resumed by M processes in either
mode (1 <-> 2 <-> 4, FSDP2 <-> DDP, CPU <-> CUDA), continuing the same data order (which never depended on
the process count: ``anyfit.data.batching``).

The two formats a checkpoint's model and optimizer state come in:

- replicated (``runtime.sharding: none``): ``*.safetensors`` (what ``save_pretrained`` writes; only the adapter
  for LoRA) and ``optimizer.pt`` (the optimizer's own state dict, keyed by parameter position);
- sharded (FSDP2): ``sharded/``, every process's slices written by ``torch.distributed.checkpoint`` (DCP),
  keyed by parameter name.

Each format is read by the backend that writes it and no other (``Backend.read_states``), whichever layout the
reading run has: ``load_states`` finds the writer (``writer_of``) and has it fill the reader's objects; the
manifest check asks it which files its states need (``unlisted_states``). Same mode: each is read back as
written (bit-identical continuation; DCP re-cuts shards for another process count by itself). Across modes,
PyTorch's own tools do the moving, nothing here re-cuts a tensor by hand:

- sharded -> replicated: DCP loads into whole tensors as readily as into shards: the unsharded model's and
  optimizer's state dicts by name (``get_state_dict``) are filled from the slices, then set back.
- replicated -> sharded: the weights go into the model before it is sharded (on process 0 alone when the
  others receive their shards from it), read as a replicated resume reads them; ``optimizer.pt`` is re-keyed
  from positions to names (the one hand-written step: PyTorch reads only name-keyed full state dicts across
  layouts) and given to ``set_optimizer_state_dict`` as a full state dict, which keeps each process's slice.

DeepSpeed ZeRO-3 checkpoints (``deepspeed/``, the engine's own files) continue under ZeRO-3 on as many
processes as wrote them (``continue_problem``); ``anyfit export`` reads any of the three in one process
(``Backend.read_whole``).
"""

from anyfit.backends.base import Backend, Loaded, local_bytes, local_numel, unwrapped
from anyfit.backends.choose import (
    choose_backend,
    choose_sequence_parallel,
    continue_problem,
    load_states,
    unlisted_states,
    writer_of,
)

__all__ = ["Backend", "Loaded", "choose_backend", "choose_sequence_parallel", "continue_problem", "load_states",
           "local_bytes", "local_numel", "unlisted_states", "unwrapped", "writer_of"]
