"""Memory of one training step, per device (per rank), from the model's shape and a ``Setup``: weights,
gradients, optimizer states, saved activations (counted tensor by tensor as autograd saves them in a Hugging
Face decoder layer), logits, transient copies and a runtime overhead; plus the host RAM the run needs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from anyfit.hardware.runtime import EIGHT_BIT_OPTIMIZERS
from anyfit.model.shape import ModelShape, Projection, kv_cache_bytes
from anyfit.planning.setup import (
    _DROPOUT_MASK_BYTES,
    BNB_BLOCK,
    BYTES,
    EIGHT_BIT_STATE_BYTES,
    NF4_BYTES_PER_PARAM,
    OPTIMIZER_NAMES,
    RUNTIME_OVERHEAD_GIB,
    Setup,
)
from anyfit.units import GIB


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device (per rank) at the peak of a training step; the device fields sum to ``peak``.
    ``host`` is the host RAM of the whole machine the run needs besides (not part of ``peak``)."""

    weights: int
    gradients: int  # the gradients alive at the peak moment
    optimizer: int
    activations: int
    logits: int
    transient: int  # autocast weight copies, DDP buckets, FSDP gathers, the optimizer step's temporaries
    overhead: int
    phase: str  # when the peak happens: "forward/backward" or "optimizer step"
    eval_kv_cache: int = 0  # KV cache of evaluation generation (not part of the training peak)
    trainable_params: int = 0
    notes: tuple[str, ...] = ()
    host: int = 0  # host RAM on the machine: the model as read (once per process unsharded), or offloaded state

    @property
    def peak(self) -> int:
        return (self.weights + self.gradients + self.optimizer + self.activations + self.logits + self.transient
                + self.overhead)

    def as_dict(self) -> dict[str, Any]:
        fields = ("weights", "gradients", "optimizer", "activations", "logits", "transient", "overhead")
        out: dict[str, Any] = {f"{k}_gib": round(getattr(self, k) / GIB, 3) for k in fields}
        out.update(peak_gib=round(self.peak / GIB, 3), phase=self.phase, per="device (rank)",
                   host_gib=round(self.host / GIB, 3), eval_kv_cache_gib=round(self.eval_kv_cache / GIB, 3),
                   trainable_params=self.trainable_params, notes=list(self.notes))
        return out


@dataclass(frozen=True)
class Activations:
    """Saved-activation bytes per token: per decoder layer, after the last layer, and per checkpointed layer."""

    per_layer: float
    head: float
    checkpoint_input: float


def activation_bytes(shape: ModelShape, setup: Setup) -> Activations:
    """Bytes autograd keeps per token for the backward pass, tensor by tensor.

    A Korthikanti et al. ("Reducing Activation Recomputation in Large Transformer Models", 2022) count
    adapted to what Hugging Face decoders and PyTorch actually save:

    - no s^2 attention-probability term: SDPA (flash / memory-efficient kernels) saves q, k, v, the output
      and a log-sum-exp per head. With a padding mask, k and v are first repeated to all heads (GQA is only
      passed natively to SDPA without a mask) and the boolean mask is converted to the compute dtype in
      every layer: ``a x seq`` bytes per token per layer.
    - RMSNorm computes in fp32: it keeps an fp32 copy of its input; its output is kept only when the norm
      weight trains.
    - SwiGLU keeps the gate output, SiLU output and up output, plus the product as the down projection's
      input.
    - under autocast each linear casts its input separately (autocast caches casts of weights only), so a
      normalised hidden state read by q, k and v is kept three times in bf16.
    - a frozen linear keeps no input (but a 4-bit one does: ``_four_bit_inputs``); a LoRA adapter keeps its
      dropout output (or mask/noise) and the rank-r intermediate.

    With gradient checkpointing a checkpointed layer keeps only its input (``checkpoint_input``), and one
    layer is recomputed at a time during the backward pass. A tiled MLP (``anyfit.model.tiled``) keeps its input
    only: none of the MLP's intermediates, casts or adapter tensors. Under sequence parallelism the attention
    runs without a mask (Ulysses drops it; causal by position), so k and v are not repeated and no mask is cast;
    per token of a process's part the rest is as above (after the all-to-all a process holds the whole sequence
    for 1/N of the heads: the same bytes).
    """
    a = BYTES[setup.precision]  # compute dtype
    # The residual stream has the embedding's dtype: the weight dtype, except QLoRA with lora.qlora_upcast (PEFT
    # upcasts non-quantized weights to fp32) and FSDP2 mixed precision (the gathered embedding is already in the
    # compute dtype). Adding a bf16 branch to an fp32 residual stays fp32.
    rs = 4 if setup.method == "qlora" and setup.qlora_upcast else setup.compute_weight_bytes
    casts = a < rs  # autocast casts each linear's input
    h, inter, q = shape.hidden_size, shape.intermediate_size, shape.q_dim
    # padded batches carry a mask (a model with state layers packs too: they run per example inside the packed row)
    masked = setup.padding and setup.sequence_parallel == 1
    repeat_kv = masked and setup.device != "mps"  # torch >= 2.13 MPS takes GQA with a mask
    kv = q if repeat_kv else shape.kv_dim
    full = setup.method == "full"

    norm = 4 * h + 4 + (rs * h if full else 0)  # fp32 input copy + rsqrt (+ normalised input for the weight grad)
    attention = a * (2 * q + 2 * kv) + 4 * shape.num_heads + (a * setup.seq_len if masked else 0)
    tiled = setup.tiled_mlp
    mlp = rs * h if tiled else (3 if shape.gated_mlp else 1) * a * inter  # tiled: the MLP's input, nothing else

    inputs = linear_inputs(shape, setup, a, rs, casts)
    per_layer = 2 * norm + attention + mlp + inputs

    head = 4 * h + 4  # final norm's fp32 input copy
    if full:  # normalised input for the norm weight, and the head's input (cast under autocast)
        head += rs * h + (a if casts else rs) * h
    return Activations(per_layer=per_layer, head=head, checkpoint_input=rs * h)


def linear_inputs(shape: ModelShape, setup: Setup, a: int, rs: int, casts: bool) -> float:
    """Bytes per token per layer that the linear layers keep of their inputs (``activation_bytes``), grouped by the
    tensor they read (``count / layers`` modules per layer)."""
    full = setup.method == "full"
    # The attention output is SDPA's own output, already counted: SDPA lays it out as (batch, seq, heads,
    # dim), so the reshape before o_proj copies nothing.
    groups: dict[str, list[Projection]] = {}
    for p in shape.projections:
        groups.setdefault(p.group, []).append(p)
    layers = max(1, shape.num_layers)
    inputs = 0.0
    if setup.tiled_mlp:  # what the MLP's linears keep is recomputed tile by tile in the backward
        groups = {g: projs for g, projs in groups.items() if g not in ("mlp_in", "mlp_mid")}
    if full:
        for group, projs in groups.items():
            d = projs[0].d_in
            if group in ("attn_in", "mlp_in"):
                # The norm's output: kept once for all its readers, or one cast copy per reader under autocast.
                inputs += sum(p.count for p in projs) / layers * a * d if casts else rs * d
            elif group == "mlp_mid":
                inputs += a * d  # the MLP's inner activation, read by the down projection
            elif group == "other":  # a layout without a formula: every module's input counted
                inputs += a * sum(p.count * p.d_in for p in projs) / layers
    else:
        targets = set(shape.lora_targets(setup.lora_targets))
        separate = a < 4  # PEFT casts the input to the fp32 adapter, autocast back to `a`: one copy per adapter
        mask = _DROPOUT_MASK_BYTES.get(setup.device, 1)
        for group, projs in groups.items():
            hit = [p for p in projs if p.name in targets]
            if not hit:
                continue
            readers = sum(p.count for p in hit) / layers
            d = hit[0].d_in
            if setup.lora_dropout > 0:
                inputs += readers * (mask + a) * d  # dropout mask (or noise) + dropout output, per adapter
            elif separate or group == "other":
                inputs += readers * a * d
            elif group != "attn_out":  # fp32 without dropout: the adapters keep the very tensor the base reads
                inputs += a * d
            inputs += readers * a * setup.lora_r  # lora_A's output, kept by lora_B
        inputs += split_expert_inputs(shape, setup, a)
        if setup.method == "qlora":
            inputs += _four_bit_inputs(groups, layers, a, casts)
    return inputs


def _four_bit_inputs(groups: dict[str, list[Projection]], layers: int, a: int, casts: bool) -> float:
    """What bitsandbytes' 4-bit matmul keeps, frozen or not: ``MatMul4Bit`` saves its input for the backward
    whenever that input needs a gradient (it always does under QLoRA: adapters train below it), each in the
    compute dtype. Under an fp32 residual stream every module casts the norm's output itself (one copy per
    reader); the attention output is SDPA's own (counted), the down projection's input the MLP product."""
    kept = 0.0
    for group, projs in groups.items():
        readers, d = sum(p.count for p in projs) / layers, projs[0].d_in
        if group in ("attn_in", "mlp_in"):
            kept += (readers if casts else 1) * a * d
        elif group == "mlp_mid":
            kept += a * d
        elif group == "other":
            kept += readers * a * d
    return kept


def logits_bytes(shape: ModelShape, tokens: int, logit_bytes: int = 4, chunk: int = 0) -> int:
    """Peak bytes of the logits and the loss over ``tokens`` trained positions.

    ``chunk`` = 0 (train.loss_chunk_tokens=0, torch's cross-entropy on upcast logits): 12 bytes per logit.
    In the backward pass three fp32 (n, V) tensors are alive at once: the saved log-softmax, the NLL
    gradient and the log-softmax gradient. With a 152k vocabulary that is 1.8 MB per token.

    ``chunk`` > 0 (anyfit's chunked cross-entropy, the default): the logits (kept for backward) and their
    gradient in the logits' own dtype. fp32 logits need nothing more (backward writes softmax - one-hot
    straight into the gradient); half-precision ones add one fp32 chunk of rows: the upcast copy and the
    softmax. Measured on CPU (benchmarks/PLAN_VS_MEASURED.md): 8 bytes per fp32 logit.
    """
    if chunk <= 0:
        return 12 * tokens * shape.vocab_size
    transient = 0 if logit_bytes == 4 else 8 * min(tokens, chunk) * shape.vocab_size
    return 2 * logit_bytes * tokens * shape.vocab_size + transient



def _trainable_tensors(shape: ModelShape, setup: Setup) -> tuple[list[tuple[int, int, int]], int]:
    """The trainable matrices as (rows, cols, count), and the elements of trainable 1-D tensors."""
    if setup.lora:
        targets = set(shape.lora_targets(setup.lora_targets))
        r = setup.lora_r
        mats = [m for p in shape.projections if p.name in targets for m in ((r, p.d_in, p.count), (p.d_out, r, p.count))]
        return mats, 0
    h = shape.hidden_size
    mats = [(p.d_out, p.d_in, p.count) for p in shape.projections] + [(shape.vocab_size, h, 1)]
    if shape.embedding_params > shape.vocab_size * h:  # learned positions (GPT-2)
        mats.append(((shape.embedding_params - shape.vocab_size * h) // h, h, 1))
    if shape.head_params:
        mats.append((shape.head_params // h, h, 1))
    return mats, max(0, shape.params - sum(r * c * n for r, c, n in mats))


def trained_parameters(shape: ModelShape, setup: Setup) -> tuple[int, int]:
    """(the parameters that train in the run's own way, the parts that train whole beside LoRA adapters).

    The first: LoRA's adapters (fp32; with model.train_vision=lora also the vision tower's), or in a full fine-tune
    every parameter of the language model and the composite's parts that train (train_vision=full,
    train_projector), all in the weight dtype. The second, LoRA only: the tower and projector trained whole, as
    PEFT's modules_to_save trains them: a copy of the module in the loaded (weight) dtype."""
    whole = shape.fully_trained_outside(setup.train_vision, setup.train_projector)
    if not setup.lora:
        return shape.params + whole, 0
    tower = shape.tower_lora_params(setup.lora_r, setup.lora_targets) if setup.train_vision == "lora" else 0
    return shape.lora_params(setup.lora_r, setup.lora_targets, setup.lora_experts) + tower, whole


def optimizer_state_bytes(shape: ModelShape, setup: Setup) -> int:
    """Optimizer-state bytes per rank (``train.optimizer``, divided over the shards under FSDP).

    - AdamW: two states (exp_avg, exp_avg_sq) in the parameter dtype: 8 bytes per fp32 parameter.
    - 8-bit AdamW (bitsandbytes): 1 byte per state + an fp32 absmax per 256 elements per state
      (``EIGHT_BIT_STATE_BYTES`` = 2.03 bytes per parameter); 1-D tensors keep fp32 states.
    - Adafactor (torch.optim.Adafactor with its defaults, read in torch/optim/_adafactor.py): no first moment;
      a matrix keeps a row factor (rows x 1) and a column factor (1 x cols) of its second moment, a vector a
      full second moment, all in the gradient's dtype. FSDP2 shards dim 0, so a rank's row factor covers its
      rows and the column factor spans all columns.
    """
    shard = setup.shards
    trainable, whole = trained_parameters(shape, setup)
    grad_bytes = 4 if setup.lora else setup.weight_bytes
    # the parts of a composite outside the language model that train: not among _trainable_tensors' matrices
    outside = whole if setup.lora else shape.fully_trained_outside(setup.train_vision, setup.train_projector)
    if setup.optimizer == "adamw":
        return int(2 * (trainable * grad_bytes + whole * setup.weight_bytes) / shard)
    mats, vectors = _trainable_tensors(shape, setup)
    if setup.optimizer in EIGHT_BIT_OPTIMIZERS:
        return int(((trainable + whole - vectors) * EIGHT_BIT_STATE_BYTES + vectors * 8) / shard)
    if setup.optimizer == "adafactor":
        # the tower's and projector's matrices are not listed one by one: a full second moment for each of their
        # parameters, an upper bound of the factored one
        factored = sum(n * (r / shard + c) for r, c, n in mats)
        return int((factored + vectors / shard) * grad_bytes + outside * setup.weight_bytes / shard)
    raise ValueError(f"unknown optimizer {setup.optimizer!r}")


def _weights(shape: ModelShape, setup: Setup, notes: list[str]) -> tuple[float, int, int, bool]:
    """(bytes of the loaded model, trainable parameters, bytes per gradient, whether the head trains)."""
    if setup.method == "qlora":
        quantized = shape.body_linear_params
        rest = 4 if setup.qlora_upcast else setup.weight_bytes
        loaded = quantized * NF4_BYTES_PER_PARAM + (shape.params - quantized) * rest
        notes.append("QLoRA: body linears in NF4 (0.52 B/param with constants); embeddings, head and norms "
                     + ("upcast to fp32 by PEFT's prepare_model_for_kbit_training" if setup.qlora_upcast else
                        f"kept in {rest} bytes (lora.qlora_upcast=false)"))
    else:
        loaded = shape.params * setup.weight_bytes
    loaded += shape.outside_params * setup.weight_bytes  # a composite's tower, projector, audio: always loaded
    trainable, whole = trained_parameters(shape, setup)
    if setup.lora:
        loaded += trainable * 4  # PEFT keeps adapters in fp32
        loaded += whole * setup.weight_bytes  # modules_to_save trains a copy beside the frozen original
        grad_bytes = 4
        head_trains = False  # the head is frozen: no weight gradient
    else:
        grad_bytes = setup.weight_bytes  # gradients and AdamW states take the parameter dtype
        head_trains = True
    return loaded, trainable, grad_bytes, head_trains


def offloaded_activation_bytes(shape: ModelShape, setup: Setup, tokens: int) -> int:
    """What ``model.activation_offload`` moves to host RAM per micro-batch of ``tokens`` (anyfit.model.offload):
    the decoder body's saved tensors, each checkpointed layer's input only; the output head's stay."""
    if not setup.activation_offload:
        return 0
    act = activation_bytes(shape, setup)
    recomputed = setup.checkpointed_layers(shape.num_layers)
    return int(tokens * (recomputed * act.checkpoint_input + (shape.num_layers - recomputed) * act.per_layer))


def activations_and_logits(shape: ModelShape, setup: Setup, tokens: int, grad_bytes: int,
                            head_trains: bool) -> tuple[int, int]:
    """(saved activations, logits and loss) of one micro-batch of ``tokens`` at the forward/backward peak."""
    a = BYTES[setup.precision]
    act = activation_bytes(shape, setup)
    # The loss and the output head: 12 bytes per logit while the loss's backward runs; right after, the
    # head's weight gradient (a new V x h tensor, accumulated into .grad) next to the logits' gradient.
    logit_bytes = 4 if setup.loss_chunk_tokens <= 0 else a  # the head's output dtype (autocast: a)
    head_grad = shape.vocab_size * shape.hidden_size * grad_bytes if head_trains else 0
    if setup.fused_loss:
        # anyfit.training.loss.FusedHeadCrossEntropy: one chunk's fp32 logits and their low-precision copy, the
        # head weight cast once, its fp32 gradient accumulator (then cast to the weight's dtype), and the head's
        # input kept for the backward (already among the head's activations when the model trains fully)
        chunk = setup.loss_chunk_tokens or 1024
        head = shape.vocab_size * shape.hidden_size
        logits = (min(chunk, tokens) * shape.vocab_size * (4 + a) + (head * a if a < setup.weight_bytes else 0)
                  + (head * 4 + (0 if setup.fsdp else head_grad) if head_trains else 0)
                  + (0 if setup.method == "full" else tokens * shape.hidden_size * 4))
    elif setup.fsdp:  # the head's gradient is an unsharded root-unit gradient: counted with FSDP's transients
        logits = logits_bytes(shape, tokens, logit_bytes, setup.loss_chunk_tokens)
    else:
        logits = max(logits_bytes(shape, tokens, logit_bytes, setup.loss_chunk_tokens),
                     tokens * shape.vocab_size * logit_bytes + head_grad)
    recomputed = setup.checkpointed_layers(shape.num_layers)
    if setup.activation_offload:
        # The body's saved tensors are in host RAM; the backward brings back one layer at a time (recomputed or
        # unpacked), whose saved tensors plus their gradients (~ the same again) sit beside the head's.
        layer = 2 * tokens * act.per_layer
        activations = int(tokens * act.head + max(0, layer - logits))
    elif recomputed:
        # Checkpointed layers keep their input only, the others everything, and the head's tensors stay; the
        # backward pass recomputes one layer at a time, whose saved tensors plus their gradients (~ the same
        # again) come on top once the logits are gone.
        kept = tokens * (recomputed * act.checkpoint_input + (shape.num_layers - recomputed) * act.per_layer
                         + act.head)
        recompute = 2 * tokens * act.per_layer
        activations = int(kept + max(0, recompute - logits))
    else:
        activations = int(tokens * (shape.num_layers * act.per_layer + act.head))

    return activations, logits


def tower_activation_bytes(shape: ModelShape, setup: Setup, notes: list[str] | None = None) -> int:
    """A trained vision tower's saved tensors for one micro-batch, each example with images at the processor's size
    limit (``shape.tower_patches``; 0 where the processor was not on hand). A frozen tower keeps none (it runs
    without autograd: anyfit.model.vision); a trained one is checkpointed with the decoder, keeping each layer's
    input and recomputing one layer at a time."""
    if setup.train_vision == "frozen" or not shape.tower_patches:
        return 0
    a = BYTES[setup.precision]
    patches = setup.micro_batch * shape.tower_patches
    layers = max((p.count for p in shape.tower_projections), default=1)
    if setup.gradient_checkpointing:
        per_layer = shape.tower_saved_per_patch / layers
        saved = int(patches * (layers * shape.tower_hidden * setup.compute_weight_bytes + 2 * per_layer * a))
    else:
        saved = int(patches * shape.tower_saved_per_patch * a)
    if notes is not None:
        notes.append(f"the trained vision tower keeps {saved / GIB:.2f} GiB for its backward ({shape.tower_patches:,} "
                     "patches an example: its images at the processor's size limit)")
    return saved


def _adapted_experts(shape: ModelShape, setup: Setup) -> list:
    """The routed experts' fused tensors that carry an adapter."""
    targets = set(shape.lora_targets(setup.lora_targets, setup.lora_experts)) if setup.lora else set()
    return [p for p in shape.experts if p.name in targets and setup.lora_experts]


def splits_experts(shape: ModelShape, setup: Setup) -> bool:
    """Whether the run computes the experts' adapters as base plus low-rank path (anyfit.model.expert_lora)."""
    return setup.lora_split_experts and shape.experts_split


def split_expert_inputs(shape: ModelShape, setup: Setup, a: int) -> float:
    """Bytes per token per layer the split path keeps for the adapters' gradients beyond the frozen-expert run: the
    layer's token rows (once, not the top_k routed copies) when the tensor that reads them (gate/up) is adapted. The
    routed rows, the down projection's input (rebuilt from the pre-activation its activation keeps anyway) and the
    r-wide products are rebuilt in the backward (anyfit.model.expert_lora.SplitProjection)."""
    if not splits_experts(shape, setup):
        return 0.0
    return shape.hidden_size * a if any(p.name != "down_proj" for p in _adapted_experts(shape, setup)) else 0.0


def folded_expert_bytes(shape: ModelShape, setup: Setup) -> tuple[int, int]:
    """LoRA on a mixture of experts' fused expert tensors: (bytes kept from the forward to the backward, bytes more
    around the backward), outside the activations per token.

    PEFT's path (lora.split_experts=false, or experts the split path does not reproduce): PEFT folds each adapter
    into its tensor in every forward (``W + BA``, one ``baddbmm`` in the weight's dtype) and the experts' matmuls
    keep that folded copy for their backward: a second copy of the experts of every MoE layer that is not
    checkpointed; in the backward one layer's folded copy (recomputed or kept) and its gradient, both of the
    tensor's size, exist at once.

    The split path keeps views of the factors (nothing); the backward makes one layer's factors contiguous for the
    grouped matmuls (a copy of that layer's adapter in the weights' dtype); its per-token part is
    ``split_expert_inputs``. Measured on a tiny model: tests/unit/planning/test_moe_plan.py."""
    fused = _adapted_experts(shape, setup)
    if not fused:
        return 0, 0
    moe_layers = max(1, fused[0].count // max(1, shape.num_experts))
    dtype = 4 if setup.method == "qlora" and setup.qlora_upcast else setup.weight_bytes  # experts are never 4-bit
    if splits_experts(shape, setup):
        return 0, sum(setup.lora_r * (p.d_in + p.d_out) * p.count for p in fused) // moe_layers * dtype
    per_layer = sum(p.d_in * p.d_out * p.count for p in fused) // moe_layers * dtype
    recomputed = round(moe_layers * setup.checkpointed_layers(shape.num_layers) / max(1, shape.num_layers))
    return (moe_layers - recomputed) * per_layer, 2 * per_layer


def forward_transients(shape: ModelShape, setup: Setup, trainable: int, grad_bytes: int, head_trains: bool,
                        notes: list[str]) -> int:
    """Bytes alive only around the forward/backward: autocast's weight copies, DDP buckets, FSDP's gathered
    layers and gradients in flight, QLoRA's dequantized weight."""
    n = setup.processes
    a = BYTES[setup.precision]
    layers = max(1, shape.num_layers)
    transient = 0
    if not setup.fsdp:
        if not setup.lora and a < setup.weight_bytes:
            transient += shape.matmul_params * a  # autocast's cached low-precision copy of every matmul weight
            notes.append(f"autocast keeps a {setup.precision} copy of each matmul weight until its backward")
        if setup.lora and a < 4:
            transient += trainable * a  # the same for the fp32 adapters
        if n > 1:
            transient += trainable * grad_bytes  # DDP gradient buckets (gradient_as_bucket_view off)
            notes.append("DDP: gradient buckets hold a second copy of the gradients")
    else:
        # FSDP2, one unit per decoder layer plus the root (embeddings, final norm, head): the layer being
        # computed and the prefetched next one are gathered unsharded; the root unit stays gathered from the
        # start of the forward to the end of the backward (fully_shard does not reshard the root after
        # forward); the layer's unsharded gradients and its fp32 reduce-scatter input coexist while it reduces
        # (one reduce-scatter buffer in flight: FSDP2's default); the root's unsharded head/embedding gradient
        # waits for the root's reduce-scatter at the end of the backward.
        cw = setup.compute_weight_bytes
        root = shape.params - layers * shape.layer_params
        adapters = trainable / layers if setup.lora else 0
        gathered = (2 * (shape.layer_params + adapters) + root) * cw
        grad_compute = a if setup.mixed_fsdp else grad_bytes
        in_flight = (adapters if setup.lora else shape.layer_params) * (grad_compute + 4)
        root_grad = shape.vocab_size * shape.hidden_size * grad_compute if head_trains else 0
        transient += int(gathered + in_flight + root_grad)
        notes.append(f"FSDP full shard over {n}: weights, gradients and optimizer states divided by {n}; one layer "
                     f"(plus the prefetched next and the embedding/head unit) gathered "
                     f"{'in ' + setup.precision + ' ' if setup.mixed_fsdp else ''}at a time")
    if setup.method == "qlora":
        largest = max(p.d_in * p.d_out for p in shape.projections)
        transient += 2 * largest * a  # a dequantized weight (and its transposed use in backward)
    kept, around = folded_expert_bytes(shape, setup)
    if kept or around:
        transient += kept + around
        if not splits_experts(shape, setup):
            notes.append(f"LoRA on the routed experts: PEFT folds each adapter into its expert tensor per forward and "
                         f"the folded copy stays until the backward ({(kept + around) / GIB:.1f} GiB; gradient "
                         "checkpointing keeps one layer's, lora.split_experts=true none)")
    return transient


def host_bytes(shape: ModelShape, setup: Setup, loaded: float, sharded_state: int, tokens: int,
                notes: list[str]) -> int:
    """Host RAM of the machine: the model as read, before moving or sharding it, and what is offloaded there.

    Replicated, each process reads the whole model; sharded, only process 0 does, and the others receive their
    shards from it (anyfit.backends.fsdp.shard_model), under offload into host RAM while it still holds it.
    ``sharded_state``: all processes' weights, gradients, optimizer states and step temporaries (under offload)."""
    n = setup.processes
    host = int(n * loaded) if not setup.fsdp else int(loaded * (2 if setup.offload else 1))
    if setup.method == "qlora":
        host = 0  # QLoRA loads straight onto the GPU
    if setup.offload:
        host = max(host, sharded_state)
        notes.append(f"CPU offload: sharded fp32 weights, gradients and optimizer states in host RAM "
                     f"({sharded_state / GIB:.1f} GiB on the machine); the optimizer step runs on the CPU")
    if setup.activation_offload and setup.device == "cuda":
        moved = offloaded_activation_bytes(shape, setup, tokens)
        host += n * moved
        notes.append(f"activation offload: {moved / GIB:.1f} GiB of the decoder's saved tensors per process in host "
                     f"RAM, copied out and back each micro-batch")
    if setup.device in ("cpu", "mps"):
        host = 0  # the device memory is the host memory: already in the peak
    return host


def estimate_memory(shape: ModelShape, setup: Setup, overhead_gib: float | None = None,
                    eval_tokens: int | None = None) -> MemoryEstimate:
    """Peak memory per device (per rank) of one training step (see the module docstring for the policy assumed).

    The peak is the larger of two moments:
    - forward/backward: weights + optimizer states + activations + logits and loss (+ the gradients of the
      earlier micro-batches of the step, none with a single micro-batch) + autocast's weight copies or
      FSDP's gathered layers and gradients in flight;
    - the optimizer step: weights + optimizer states + all gradients + the step's temporaries
      (foreach AdamW allocates one fp32 copy of the trainable parameters, fused AdamW none, Adafactor a
      full-size variance estimate of one tensor at a time). Under CPU offload the step runs on the host.
    """
    notes: list[str] = []
    n = setup.processes
    shard = setup.shards
    a = BYTES[setup.precision]

    loaded, trainable, grad_bytes, head_trains = _weights(shape, setup, notes)
    whole = trained_parameters(shape, setup)[1]  # LoRA beside a whole tower/projector: their gradients' own dtype
    gradient_bytes = trainable * grad_bytes + whole * setup.weight_bytes
    weights = int(loaded / shard)
    gradients = gradient_bytes // shard
    optimizer = optimizer_state_bytes(shape, setup)
    if setup.optimizer in EIGHT_BIT_OPTIMIZERS:
        library = "torchao, sharded with the weights" if setup.fsdp else "bitsandbytes, CUDA"
        notes.append(f"{OPTIMIZER_NAMES[setup.optimizer]} ({library}): both moments in 1 byte + an fp32 "
                     f"absmax per {BNB_BLOCK} values, {EIGHT_BIT_STATE_BYTES:.2f} B/param instead of 8")
    elif setup.optimizer == "adafactor":
        notes.append("Adafactor (torch): no first moment, second moment factored into rows + columns per matrix")

    tokens = setup.local_tokens
    if setup.sequence_parallel > 1:
        notes.append(f"sequence parallel over {setup.sequence_parallel} (DeepSpeed Ulysses): each process holds "
                     f"1/{setup.sequence_parallel} of every sequence's activations and logits")
    if setup.tiled_mlp:
        notes.append("tiled MLP: each MLP keeps its input only; its intermediates are recomputed tile by tile")
    activations, logits = activations_and_logits(shape, setup, tokens, grad_bytes, head_trains)
    activations += tower_activation_bytes(shape, setup, notes)

    transient = forward_transients(shape, setup, trainable, grad_bytes, head_trains, notes)
    if whole and setup.processes > 1 and not setup.fsdp:
        transient += whole * setup.weight_bytes  # their DDP gradient buckets, beside the adapters'
    if setup.device == "cpu":
        notes.append("CPU: the runtime overhead includes ~0.25 GiB of glibc heap slack; on Linux, "
                     "MALLOC_MMAP_THRESHOLD_=131072 makes freed activations go back to the OS")

    # --- the optimizer step's temporaries ---
    if setup.optimizer == "adamw":
        step_temp = 0 if setup.fused_optimizer else gradient_bytes // shard
    elif setup.optimizer == "adafactor":  # the single-tensor path's full-size variance estimate, one tensor at a time
        step_temp = max(r * c for r, c, _ in _trainable_tensors(shape, setup)[0]) * grad_bytes // shard
    else:
        step_temp = 0  # bitsandbytes updates in place, block by block

    # --- gradients accumulated over the earlier micro-batches of the window ---
    accumulated = 0
    if setup.accumulation > 1:
        if setup.fsdp and setup.fsdp_unsharded_accumulation:
            accumulated = trainable * 4  # FSDP2 keeps unsharded gradients in the fp32 reduce dtype on the device
            notes.append(f"FSDP with accumulation: anyfit reduce-scatters only at the window's last micro-batch, so "
                         f"each rank holds an unsharded fp32 gradient ({accumulated / GIB:.1f} GiB) meanwhile")
        elif not setup.offload:
            accumulated = gradients

    host = host_bytes(shape, setup, loaded, n * (weights + gradients + optimizer + step_temp), tokens, notes)
    if setup.offload:  # the sharded state is in host RAM (counted there), the optimizer step runs on the CPU
        weights = gradients = optimizer = step_temp = 0

    fwd_bwd = accumulated + activations + logits + transient
    step = gradients + step_temp
    overhead = int((RUNTIME_OVERHEAD_GIB[setup.device] if overhead_gib is None else overhead_gib) * GIB)
    kv = kv_cache_bytes(shape, eval_tokens or setup.seq_len, setup.micro_batch, a)
    common = dict(weights=weights, optimizer=optimizer, overhead=overhead, eval_kv_cache=kv,
                  trainable_params=trainable + whole, notes=tuple(notes), host=host)
    if fwd_bwd >= step:
        return MemoryEstimate(gradients=accumulated, activations=activations, logits=logits, transient=transient,
                              phase="forward/backward", **common)
    return MemoryEstimate(gradients=gradients, activations=0, logits=0, transient=step_temp, phase="optimizer step",
                          **common)
