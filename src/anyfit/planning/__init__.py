"""Planning: will this config fit on that machine, with which batch split, and how fast? (``anyfit plan``,
and ``runtime.sharding=auto`` for the training loop.)

Everything is computed from the model's *config* (no weights are read) and the run config:

1. ``anyfit.model.shape.model_shape``: the architecture's sizes and exact parameter count (a closed formula
   for the Llama family and GPT-2; other architectures are counted on PyTorch's meta device).
2. ``anyfit.planning.memory.estimate_memory``: the peak bytes per device (per rank) of one training step, as
   the sum of what is alive at the peak (weights, gradients, optimizer states, saved activations, logits and
   their gradient, transient copies, a fixed runtime overhead), plus the host RAM the run needs besides. The
   activation term was checked tensor by tensor against ``torch.autograd.graph.saved_tensors_hooks``
   (tests/unit/planning/test_planner.py) and end to end against the peak RSS of real CPU runs
   (benchmarks/PLAN_VS_MEASURED.md). Each memory saver is counted where it acts: gradient checkpointing
   (``model.checkpoint_every``), the optimizer's states (``train.optimizer``: AdamW, 8-bit AdamW, Adafactor),
   FSDP2 full sharding (``runtime.sharding``; while accumulating, each rank holds a full unsharded fp32
   gradient, because anyfit's loop skips the reduce-scatter until the window's last micro-batch) and CPU
   offload (``runtime.fsdp_offload``: sharded fp32 state in host RAM, reported and checked).
3. ``anyfit.planning.ladder.plan_target``: for one machine, the largest micro-batch that fits under a safety
   margin (the rule of ``micro_batch=auto``), the accumulation that keeps the configured effective batch, and,
   when the run as configured does not fit, the cheapest savers that do (the ladder: ``plan_target``), then
   LoRA, QLoRA, more GPUs. ``recommend_sharding`` answers ``runtime.sharding=auto`` with the same estimates.
4. ``anyfit.planning.time.step_time``: on CUDA the matmul FLOPs at the share of the dense peak matmuls reach
   (calibrated per architecture against published runs) plus the bytes the operations between them stream
   at the memory bandwidth; on Macs and CPUs FLOPs over the peak times a model-FLOPs utilisation; then the
   bandwidth-bound optimizer update, and the communication compute cannot hide (DDP's
   all-reduce, FSDP's all-gathers and reduce-scatter, CPU offload's copies) at the target's interconnect
   bandwidth. With a price per hour, the cost per 100 steps and per epoch follow.
5. ``anyfit.planning.report``: the printed table and ``--json``; ``anyfit.planning.presets``: the machines
   (GPUs, Macs, this one) with their memory, peak FLOPs, bandwidth and price.

The one mapping from config keys to what the estimates take is ``anyfit.planning.setup.setup_for``; the memory
savers themselves (their keys, ladder tiers and values, words, estimate terms and model hooks) are the rows of
``anyfit.planning.savers.SAVERS``.

The estimates describe anyfit's own loop and policies: fp32 master weights with bf16/fp16 autocast for
full fine-tuning (FSDP2 mixed precision when sharded), a frozen base in the compute dtype for LoRA on CUDA
(fp32 on CPU/MPS), fp32 adapters (PEFT upcasts them), token-sum loss (chunked fp32 cross-entropy by
default), the configured optimizer (fused AdamW by default, on every device); replicated, every process reads
the whole model into host RAM; sharded, process 0 reads it and the others receive their shards.
"""
