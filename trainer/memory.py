"""Will the update fit? Peak memory per GPU of one GRPO update, from a checkpoint's config.json and train.*.

Pure arithmetic (no torch): what the update's code keeps alive at its peak, term by term:

- weights, gradients and optimizer state, in bytes per parameter by dtype, strategy, ZeRO stage, ranks and
  offload (ZeRO's own accounting: 2 B bf16 weights + 2 B bf16 grads + 12 B fp32 master, Adam m and v, split
  over the ranks by stage); the local strategy keeps fp32 weights, grads and AdamW moments (16 B), and under
  bf16 mixed precision (autocast) also the bf16 copies of the layers' weights its forward saves;
- activations: what autograd saves per token per decoder layer, counted on transformers' Qwen3 layer with
  `torch.autograd.graph.saved_tensors_hooks` (tests/test_memory_estimate.py keeps the coefficients exact),
  for every layer, or, with activation checkpointing, each layer's input plus one layer recomputed;
- the log-prob head as trainer/chunked_actor.py runs it: the trained positions' logits in one lm_head call
  when they fit its budget (kept for backward), else chunks of LOGIT_BUDGET / vocabulary positions, each
  recomputed in backward (pipeline/logprobs.py), with logsumexp's transient copies (under DeepSpeed too: the
  engine's forward runs the same chunks);
- the optimizer step's temporaries (none for the fused AdamW the local strategy runs on a GPU).

The worst micro-batch is assumed: `max(train.micro_batch_tokens, trajectory tokens)` tokens (a longer row
gets a micro-batch alone), every position trained, gradients of earlier micro-batches alive (a mini-batch of
several micro-batches), the optimizer state present (every update after the first loads it). Checked
against peaks measured on the CPU (tests/test_memory_estimate.py, ±25%) and, by benchmarks/gpu_check.py,
against torch.cuda.max_memory_allocated on a GPU.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from storage.errors import CleanerError

GiB = 1024**3
# trainer/chunked_actor.py's LOGIT_BUDGET (positions × vocabulary one lm_head call may hold): the same
# number, restated here so that this module needs no torch (a test keeps the two equal)
LOGIT_BUDGET = 512 * 151_936
# config.json fields of a mixture-of-experts model (Qwen3-MoE, Mixtral, DeepSeek): its experts are not sized here
MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")
# headroom a plan must leave of the card: CUDA context, allocator fragmentation, NCCL buffers
HEADROOM = 0.10
# DeepSpeed's reduce bucket and, under ZeRO-3, the gathered weights its prefetch keeps alive (elements)
DS_BUCKET_ELEMENTS = 5e8 // 2
ACTIVATION_DTYPES = ("fp32", "bf16", "fp16")


class MemoryEstimateError(CleanerError, ValueError):
    """A checkpoint config or a setting the estimate cannot read; the message names the file and field."""

    exit_code = 2


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only transformers model (Qwen2/2.5/3, Llama, Mistral layouts)."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied: bool = True
    qk_norm: bool = True  # Qwen3 normalises q and k per head
    attention_bias: bool = False
    name: str = "model"

    @classmethod
    def from_config(cls, config: dict, source: str = "config.json") -> "ModelShape":
        def need(key: str, default: int | None = None) -> int:
            value = config.get(key)
            if value is None and default is not None:
                return default
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise MemoryEstimateError(f"{source}: field {key!r} must be a positive integer (got {value!r})")
            return value

        experts = [k for k in MOE_FIELDS if config.get(k)]
        kind = config.get("model_type")
        architectures = config.get("architectures") or []
        if experts or (architectures and not any(str(a).endswith("ForCausalLM") for a in architectures)):
            what = f"a mixture of experts ({experts[0]}={config[experts[0]]})" if experts else f"{architectures[0]}"
            raise MemoryEstimateError(
                f"{source}: model_type {kind!r} is {what}; the estimate sizes dense decoder-only causal LMs "
                "(Qwen2/2.5/3, Llama, Mistral layouts)"
            )
        hidden, heads = need("hidden_size"), need("num_attention_heads")
        head_dim = need("head_dim", hidden // heads)
        return cls(
            vocab=need("vocab_size"),
            hidden=hidden,
            layers=need("num_hidden_layers"),
            heads=heads,
            kv_heads=need("num_key_value_heads", heads),
            head_dim=head_dim,
            intermediate=need("intermediate_size"),
            tied=bool(config.get("tie_word_embeddings", False)),
            qk_norm=config.get("model_type", "qwen3") == "qwen3",
            attention_bias=bool(config.get("attention_bias", False)),
            name=str(config.get("_name_or_path") or config.get("model_type") or source),
        )

    @classmethod
    def from_path(cls, path: Path) -> "ModelShape":
        """The shape of a checkpoint folder (its config.json) or of a config.json itself."""
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        try:
            config = json.loads(file.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise MemoryEstimateError(f"{file}: no such file (expected a checkpoint folder with config.json)") from None
        except IsADirectoryError:
            raise MemoryEstimateError(f"{file}: a folder, not a config.json file") from None
        except UnicodeDecodeError as e:
            raise MemoryEstimateError(f"{file}: not UTF-8 text (byte {e.start}: {e.reason})") from None
        except json.JSONDecodeError as e:
            raise MemoryEstimateError(f"{file}: not JSON ({e.msg} at line {e.lineno})") from None
        if not isinstance(config, dict):
            raise MemoryEstimateError(f"{file}: expected a JSON object")
        shape = cls.from_config(config, str(file))
        return replace(shape, name=path.name if path.is_dir() else path.parent.name)

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_matmul_parameters(self) -> int:
        """Parameters of one decoder layer's linear maps (what autocast casts to bf16 and saves)."""
        return 2 * self.hidden * self.q_dim + 2 * self.hidden * self.kv_dim + 3 * self.hidden * self.intermediate

    @property
    def layer_parameters(self) -> int:
        bias = (self.q_dim + 2 * self.kv_dim) if self.attention_bias else 0
        norms = 2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0)
        return self.layer_matmul_parameters + bias + norms

    @property
    def parameters(self) -> int:
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return embeddings + self.layers * self.layer_parameters + self.hidden

    @property
    def largest_tensor(self) -> int:
        return max(self.vocab * self.hidden, self.hidden * self.intermediate)


@dataclass(frozen=True)
class Plan:
    """The settings of one update that decide its memory (train.* plus the machine)."""

    strategy: str = "local"  # local | deepspeed
    zero_stage: int = 2
    ranks: int = 1  # GPUs the update runs on (train.nproc under deepspeed; 1 for local)
    param_dtype: str = "fp32"  # fp32 | bf16 | fp16 (bf16/fp16: mixed precision)
    gradient_checkpointing: bool = False
    offload_optimizer: bool = False
    attn_implementation: str = "sdpa"  # sdpa | eager | flash_attention_2
    micro_batch_tokens: int = 8192
    trajectory_tokens: int = 8192
    device: str = "cuda"  # cuda | cpu: the local AdamW differs (fused on a GPU: no temporaries; per tensor on a CPU)

    @classmethod
    def from_train(cls, train, trajectory_tokens: int, ranks: int | None = None, device: str = "cuda") -> "Plan":
        """The plan of a pipeline.config TrainConfig (settings it lacks keep their defaults)."""
        strategy = train.strategy
        return cls(
            strategy=strategy,
            zero_stage=train.zero_stage,
            ranks=(ranks or train.nproc) if strategy == "deepspeed" else 1,
            param_dtype=getattr(train, "param_dtype", "fp32"),
            gradient_checkpointing=bool(getattr(train, "gradient_checkpointing", False)),
            offload_optimizer=bool(getattr(train, "offload_optimizer", False)),
            attn_implementation=getattr(train, "attn_implementation", "sdpa"),
            micro_batch_tokens=train.micro_batch_tokens,
            trajectory_tokens=trajectory_tokens,
            device=device,
        )

    @property
    def mixed(self) -> bool:
        return self.param_dtype in ("bf16", "fp16")

    @property
    def forward_tokens(self) -> int:
        """Tokens of the largest forward: a micro-batch's budget, or one row longer than it."""
        return max(self.micro_batch_tokens, self.trajectory_tokens)

    def settings(self) -> dict[str, object]:
        """As train.* overrides (what a user types to get this plan)."""
        out: dict[str, object] = {
            "train.strategy": self.strategy,
            "train.param_dtype": self.param_dtype,
            "train.gradient_checkpointing": self.gradient_checkpointing,
        }
        if self.strategy == "deepspeed":
            out.update(
                {
                    "train.zero_stage": self.zero_stage,
                    "train.nproc": self.ranks,
                    "train.offload_optimizer": self.offload_optimizer,
                }
            )
        if self.attn_implementation != "sdpa":
            out["train.attn_implementation"] = self.attn_implementation
        out["train.micro_batch_tokens"] = self.micro_batch_tokens
        return out


@dataclass
class Estimate:
    """Bytes per GPU at the update's peak, by term; `cpu_bytes`: what offload moves to host memory (per rank)."""

    shape: ModelShape
    plan: Plan
    terms: dict[str, float] = field(default_factory=dict)
    cpu_bytes: float = 0.0

    @property
    def peak(self) -> float:
        return sum(self.terms.values())

    @property
    def host_bytes(self) -> float:
        """Host memory the node needs for offload: every rank's share (the ranks of one node)."""
        return self.cpu_bytes * max(1, self.plan.ranks)

    def fits(self, gpu_bytes: float, host_bytes: float | None = None) -> bool:
        """The peak fits each card; and, when the host's memory is known, what offload moves there fits it."""
        host_ok = host_bytes is None or self.host_bytes <= host_bytes * (1 - HEADROOM)
        return self.peak <= gpu_bytes * (1 - HEADROOM) and host_ok

    def lines(self) -> list[str]:
        out = [f"{name:<42} {value / GiB:8.2f} GiB" for name, value in self.terms.items()]
        out.append(f"{'peak per GPU':<42} {self.peak / GiB:8.2f} GiB")
        if self.cpu_bytes:
            out.append(f"{'host memory per rank (offload)':<42} {self.cpu_bytes / GiB:8.2f} GiB")
        return out


def layer_activation_bytes(shape: ModelShape, precision: str, attn: str, width: int) -> float:
    """Bytes autograd saves per token in one decoder layer (transformers' Qwen3 layer, counted with
    saved_tensors_hooks). precision: fp32 (an fp32 model), autocast (fp32 weights, bf16 compute), low (a
    bf16/fp16 model). width: the row's length (eager attention keeps its softmax, width per head)."""
    h, i, q, kv, nh, nkv = shape.hidden, shape.intermediate, shape.q_dim, shape.kv_dim, shape.heads, shape.kv_heads
    per_head = 8 * nh + 4 * nkv + 8
    if precision == "fp32":
        base = 24 * h + 16 * i + 16 * q + 16 * kv + per_head
    elif precision == "autocast":
        base = 26 * h + 8 * i + 10 * q + 10 * kv + per_head
    else:
        base = 16 * h + 8 * i + 10 * q + 10 * kv + per_head
    if attn == "eager":  # the softmax in fp32 (and its cast back), k and v repeated to every query head
        score_bytes = 4 if precision == "fp32" else 6
        base += score_bytes * nh * width + (8 if precision == "fp32" else 4) * (q - kv)
    return float(base)


def _activations(shape: ModelShape, plan: Plan, casts: float) -> dict[str, float]:
    """The forward/backward's terms at its peak. casts: autocast's bf16 weight copies (0 without autocast), alive
    until the forward's autocast region ends."""
    tokens = plan.forward_tokens
    width = min(plan.trajectory_tokens, tokens)
    precision = "fp32" if not plan.mixed else ("low" if plan.strategy == "deepspeed" else "autocast")
    per_layer = layer_activation_bytes(shape, precision, plan.attn_implementation, width) * tokens
    hidden_bytes = 2 if precision == "low" else 4  # the residual stream between layers
    body = (2 * hidden_bytes * shape.hidden + 8 * shape.head_dim + 12) * tokens  # embeddings, final norm, rotary
    # backward: the gradient of the residual stream and of one layer's largest intermediates
    working = (2 * shape.hidden + 3 * shape.intermediate) * 4 * tokens
    # trainer/chunked_actor.py (both strategies): every position trained, in one lm_head call when its logits fit
    # the budget; one call: its fp32 logits kept, plus logsumexp's transient copies; chunked: one chunk recomputed
    # in backward, its copies and its gradient
    step = max(1, LOGIT_BUDGET // shape.vocab)
    rows = tokens * shape.hidden * 4  # the trained positions' hidden states, gathered
    head = rows + 4.0 * min(tokens, step) * shape.vocab * 4
    casts_term = {"weights (bf16 copies for autocast)": casts} if casts else {}
    if not plan.gradient_checkpointing:  # the end of the forward, every layer's activations saved
        return {
            **casts_term,
            "activations (saved for backward)": shape.layers * per_layer + body,
            "log-prob head (logits)": head,
            "backward working set": working,
        }
    inputs = shape.layers * shape.hidden * hidden_bytes * tokens + body  # what checkpointing keeps of each layer
    forward_end = casts + head
    backward = per_layer + working  # one layer recomputed, and its gradients
    out = {"activations (layer inputs, checkpointed)": inputs}
    if forward_end >= backward:
        return {**casts_term, **out, "log-prob head (logits)": head}
    return {**out, "one layer recomputed in backward": per_layer, "backward working set": working}


def estimate(shape: ModelShape, plan: Plan) -> Estimate:
    p, n = float(shape.parameters), max(1, plan.ranks)
    est = Estimate(shape, plan)
    t = est.terms
    if plan.strategy == "local":
        t["weights (fp32)"] = 4 * p
        # autocast's low-precision copies of the layers' weights, cached while its region runs
        casts = 2.0 * (shape.layers * shape.layer_matmul_parameters + shape.vocab * shape.hidden) if plan.mixed else 0
        t["gradients (fp32)"] = 4 * p
        t["AdamW moments (fp32)"] = 8 * p
        # trainer/grpo.py: torch's fused AdamW on CUDA (no temporaries); on the CPU its per-tensor loop, a few
        # copies of one tensor at a time
        step_tmp = 0.0 if plan.device == "cuda" else 3 * 4 * shape.largest_tensor
    else:
        low = 2 if plan.mixed else 4
        stage = plan.zero_stage
        t[f"weights ({plan.param_dtype}{', ZeRO-3 shard' if stage == 3 else ''})"] = low * p / (n if stage == 3 else 1)
        if stage == 3:  # the layers gathered around the one computing, and the embedding/lm_head when used
            t["ZeRO-3 gathered weights"] = low * (2 * shape.layer_parameters + shape.vocab * shape.hidden)
        bucket = low * min(DS_BUCKET_ELEMENTS, p)
        optimizer = (4 * p if plan.mixed else 0) + 8 * p + 4 * p  # fp32 master, Adam m and v, fp32 gradients
        # ZeRO-3 keeps its gradient partition in the accumulation dtype (grad_partitions_flat_buffer): float32
        # under bf16 (trainer/deepspeed_update.py gives OpenRLHF grad_accum_dtype=fp32), else the weights'
        accum = 4 if (stage == 3 and plan.param_dtype == "bf16") else low
        if plan.offload_optimizer:
            # DeepSpeed 0.19's offload keeps the gradient partition in host memory (ZeRO-3: grad_partitions_flat_
            # buffer on the offload device, beside each subgroup's fp32 .grad buffer the optimizer term counts;
            # ZeRO-2: grads accumulate into the CPU fp32 partition through temp_grad_buffer_for_gpu_offload, one
            # largest tensor on the GPU, plus a host bit16 copy of the shard)
            if stage == 3:
                t["gradients (reduce bucket; shard on host)"] = bucket
                est.cpu_bytes = optimizer / n + accum * p / n
            else:
                t["gradients (bucket+tensor; shard on host)"] = bucket + low * shape.largest_tensor
                est.cpu_bytes = optimizer / n + low * p / n
        else:
            name = "fp32" if accum == 4 else plan.param_dtype
            t[f"gradients ({name} shard + bucket)"] = accum * p / n + bucket
            t["optimizer (fp32 master, Adam, grads; shard)"] = optimizer / n
        step_tmp = 0.0  # DeepSpeed steps partition by partition
        casts = 0.0
    act = _activations(shape, plan, casts)
    forward_backward = sum(act.values())
    if step_tmp > forward_backward:
        t["optimizer step temporaries"] = step_tmp  # the step comes after the activations are freed
    else:
        t.update(act)
    return est


# ---- what would fit --------------------------------------------------------------------------------------


def candidate_plans(plan: Plan, gpus: int) -> list[Plan]:
    """Plans from the given one: its own layout and DeepSpeed ZeRO-2/3 over 1, 2, 4, 8 or all the GPUs, with and
    without offload, each with mixed precision and checkpointing switched on or not, and micro-batches of its
    budget or, when that packs several trajectories, halved down to one trajectory (a row is never split)
    (`suggestions` orders them)."""
    dtypes = [plan.param_dtype] if plan.mixed else [plan.param_dtype, "bf16"]
    ckpts = [plan.gradient_checkpointing] if plan.gradient_checkpointing else [False, True]
    budgets, budget = [plan.micro_batch_tokens], plan.micro_batch_tokens
    while budget > plan.trajectory_tokens:
        budget = max(budget // 2, plan.trajectory_tokens)
        budgets.append(budget)
    layouts = [(plan.strategy, plan.zero_stage, plan.ranks, plan.offload_optimizer)]
    for ranks in sorted({r for r in (1, 2, 4, 8, gpus) if r <= gpus}):
        for stage in (2, 3):
            for offload in (False, True):
                layouts.append(("deepspeed", stage, ranks, offload))
    out, seen = [], set()
    for layout in layouts:
        for dtype in dtypes:
            for ckpt in ckpts:
                for budget in budgets:
                    strategy, stage, ranks, offload = layout
                    cand = replace(
                        plan,
                        strategy=strategy,
                        zero_stage=stage,
                        ranks=ranks,
                        offload_optimizer=offload,
                        param_dtype=dtype,
                        gradient_checkpointing=ckpt,
                        micro_batch_tokens=budget,
                    )
                    if cand not in seen:
                        seen.add(cand)
                        out.append(cand)
    return out


def _cost(base: Plan, cand: Plan) -> tuple:
    changed = sum(1 for k, v in cand.settings().items() if base.settings().get(k) != v)
    # slowdowns: offload (host ↔ GPU every step) > checkpointing (one more forward) > smaller micro-batches (a
    # trajectory's thousands of tokens already fill a GPU) > fewer of the GPUs at hand (data parallel: more ranks,
    # more tokens/s) > ZeRO-3's gathers > fp32 (bf16 runs on the tensor cores)
    return (
        cand.offload_optimizer,
        cand.gradient_checkpointing,
        -cand.micro_batch_tokens,
        -cand.ranks,
        cand.zero_stage == 3,
        not cand.mixed,
        changed,
    )


def suggestions(
    shape: ModelShape, plan: Plan, gpus: int, gpu_bytes: float, limit: int = 3, host_bytes: float | None = None
) -> list[Estimate]:
    """Up to `limit` plans that fit `gpus` cards of `gpu_bytes` (and, when given, offload a host of `host_bytes`),
    fastest first (none when nothing does): without offload before with it, without checkpointing before with it,
    the largest micro-batches, then the most ranks, ZeRO-2 before ZeRO-3, bf16 before fp32, then the fewest
    changed settings."""
    fitting = [e for e in (estimate(shape, c) for c in candidate_plans(plan, gpus)) if e.fits(gpu_bytes, host_bytes)]
    fitting.sort(key=lambda e: _cost(plan, e.plan))
    return fitting[:limit]


def longest_fitting_tokens(shape: ModelShape, plan: Plan, gpu_bytes: float, host_bytes: float | None = None) -> int:
    """The longest trajectory this plan fits (0: not even 256 tokens), by bisection on powers of two."""
    lo, hi = 0, 256
    while hi <= 1 << 20 and estimate(
        shape, replace(plan, trajectory_tokens=hi, micro_batch_tokens=min(plan.micro_batch_tokens, hi))
    ).fits(gpu_bytes, host_bytes):
        lo, hi = hi, hi * 2
    return lo


def describe(plan: Plan) -> str:
    return " ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in plan.settings().items())


def model_flops_per_token(shape: ModelShape, tokens: int) -> float:
    """Training FLOPs per trained token as MFU counts them: 6 × the parameters that multiply (forward 2, backward
    4; an untied input embedding is a lookup, not counted; a tied one is counted once, as the lm_head) plus the
    causal attention's 6 × layers × length × q_dim (scores and values over length/2 positions on average); a
    checkpointed layer's recomputed forward is not counted (model FLOPs, not hardware FLOPs)."""
    multiplying = shape.parameters - (0 if shape.tied else shape.vocab * shape.hidden)
    return 6.0 * multiplying + 6.0 * shape.layers * tokens * shape.q_dim


CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")  # v2, v1


def this_host_memory(limits: tuple[str, ...] = CGROUP_LIMITS) -> float:
    """Bytes of memory this process may use (what offload's host share must fit in, with the ranks of this node):
    the machine's, or its cgroup's limit when lower (a container, a SLURM job), which kills past it."""
    import os

    memory = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    for path in limits:
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():  # "max" (v2) or a huge number (v1): no limit
            memory = min(memory, float(text))
    return memory


class DoesNotFit(MemoryEstimateError):
    """The update's estimate exceeds the GPUs' memory: refused before anything runs."""

    exit_code = 1


def check_fits(
    shape: ModelShape, plan: Plan, gpus: int, gpu_bytes: float, card: str = "GPU", host_bytes: float | None = None
) -> Estimate:
    """The estimate when it fits; else DoesNotFit, one line naming the settings, the estimate and what would fit
    (the preflight of an update on a GPU: trainer/stage.py, where train.device resolves to CUDA). host_bytes: the
    node's memory, which offload needs room in."""
    est = estimate(shape, plan)
    if est.fits(gpu_bytes, host_bytes):
        return est
    found = suggestions(shape, plan, gpus, gpu_bytes, limit=1, host_bytes=host_bytes)
    would = (
        f"would fit: {describe(found[0].plan)} ({found[0].peak / GiB:.1f} GiB)"
        if found
        else f"no settings fit {gpus} such GPU(s): more GPUs or shorter trajectories"
    )
    if est.fits(gpu_bytes) and host_bytes:  # the card holds it; the host does not hold what offload moves there
        room = host_bytes * (1 - HEADROOM)
        need = f"{est.host_bytes / GiB:.1f} GiB of host memory for offload (estimate) of {room / GiB:.1f} GiB usable"
    else:
        room = gpu_bytes * (1 - HEADROOM)
        need = f"≈ {est.peak / GiB:.1f} GiB per GPU (estimate) of {room / GiB:.1f} GiB usable on {card}"
    raise DoesNotFit(
        f"{describe(plan)} at {plan.trajectory_tokens} tokens needs {need}; {would}; `cleaner fit` shows the breakdown"
    )
