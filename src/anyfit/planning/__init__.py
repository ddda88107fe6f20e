"""Planning: will this config fit on that machine, with which batch split, and how fast? (``anyfit plan``,
and ``runtime.sharding=auto`` for the training loop.)

Everything is computed from the model's *config* (no weights are read) and the run config:

1. ``anyfit.model.shape.model_shape``: the architecture's sizes and exact parameter count (a closed formula
   for the Llama family and GPT-2; other architectures are counted on PyTorch's meta device).
2. ``anyfit.planning.memory.estimate_memory``: the peak bytes per device (per rank) of one training step, as the sum of what is
   alive at the peak: weights, gradients, optimizer states, saved activations, the logits and their
   gradient, transient copies, and a fixed runtime overhead; plus the host RAM the run needs besides. The
   activation term counts the tensors autograd saves in a Hugging Face decoder layer (see
   ``activation_bytes``); it was checked tensor by tensor against ``torch.autograd.graph.saved_tensors_hooks``
   (tests/unit/test_planner.py) and end to end against the peak RSS of real CPU runs
   (benchmarks/PLAN_VS_MEASURED.md). The memory savers are modelled one by one:
   - gradient checkpointing, on every layer or every N-th (``model.checkpoint_every``): the checkpointed
     layers keep only their input, the others everything; one layer is recomputed at a time;
   - optimizer states (``train.optimizer``): AdamW 2 states in the parameter dtype; bitsandbytes' 8-bit
     AdamW 1 byte per state plus an fp32 absmax per 256-element block (vectors under 4,096 elements keep fp32
     states); torch's Adafactor a factored second moment (rows + columns per matrix) and no first moment;
   - FSDP2 full sharding (``runtime.sharding``): weights, gradients and states divided by the processes; one
     decoder layer gathered unsharded at a time plus the prefetched next, the root unit (embeddings, head)
     gathered for the whole step, the layer's unsharded gradients and fp32 reduce-scatter buffer in flight;
     under bf16 the gathered copies are bf16 (FSDP2's MixedPrecisionPolicy replaces autocast, so there are
     no autocast weight copies and the residual stream is bf16); while accumulating, anyfit's loop skips the
     reduce-scatter (``set_requires_gradient_sync(False)``), so each rank holds a full unsharded fp32 gradient
     until the last micro-batch;
   - CPU offload (``runtime.fsdp_offload``, FSDP2's CPUOffloadPolicy): sharded fp32 weights, gradients and
     optimizer states live in host RAM and the optimizer step runs on the CPU; the device holds the gathered
     layers, activations and gradients in flight. The host RAM this needs is reported and checked.
3. ``anyfit.planning.ladder.plan_target``: for one machine, the largest micro-batch that fits under a safety margin (the rule of
   ``micro_batch=auto``), the accumulation that keeps the configured effective batch, and, when the run as
   configured does not fit, the cheapest combination of savers that does (see ``plan_target`` for the
   ladder and its order), then LoRA, QLoRA, more GPUs. ``recommend_sharding`` answers
   ``runtime.sharding=auto`` for the training loop with the same estimates.
4. ``anyfit.planning.time.step_time``: training FLOPs per token (6N for full fine-tuning, 4N with a frozen base, plus attention
   and checkpointing's recomputation) over the device's dense peak times a model-FLOPs utilisation, the
   bandwidth-bound optimizer update, and the communication that compute cannot hide: the gradient
   all-reduce of data parallel, FSDP's all-gathers and reduce-scatter, and CPU offload's host<->device copies,
   at the target's interconnect bandwidth (NVLink, PCIe). With a price per hour, the cost per 100 steps and
   per epoch follow.
5. ``anyfit.planning.report``: the printed table and ``--json``; ``anyfit.planning.presets``: the machines
   (GPUs, Macs, this one) with their memory, peak FLOPs, bandwidth and price.

The one mapping from config keys to what the estimates take is ``anyfit.planning.setup.setup_for``.

The estimates describe anyfit's own loop and policies: fp32 master weights with bf16/fp16 autocast for
full fine-tuning (FSDP2 mixed precision when sharded), a frozen base in the compute dtype for LoRA on CUDA
(fp32 on CPU/MPS), fp32 adapters (PEFT upcasts them), token-sum loss (chunked fp32 cross-entropy by
default), the configured optimizer (fused AdamW by default, on every device); every process reads the whole
model into host RAM before moving or sharding it.
"""
