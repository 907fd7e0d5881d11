"""One pydantic config tree for every stage, loadable from YAML and overridable with dotted keys.

`cleaner train rollout.samples_per_prompt=8 purify.gammas=[0.3,0.7]` edits the tree before it is
validated, so a misspelt key fails with the path that was wrong instead of being ignored.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import re
from pathlib import Path
import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from pipeline.modes import IS_MODES, Mode
from storage.errors import CleanerError

DEFAULT_POLICY = Path(__file__).resolve().parent.parent / "policies" / "tiny-tool-policy"
DEFAULT_VLLM_VENV = Path(__file__).resolve().parent.parent / ".venv-vllm"  # scripts/setup_vllm.sh builds it


# γ > 1 can never be reached by a similarity in [0, 1]: this one value asks for "always deep".
ALWAYS_DEEP = 1.01
MAX_ITERATION_TRAJECTORIES = 10_000_000  # rollout.tasks_per_iteration × samples_per_prompt


def check_gamma(g: float) -> float:
    """SAAR's shallow/deep threshold: in [0, 1], or ALWAYS_DEEP; nan/inf/negatives are mistakes."""
    if not (0.0 <= g <= 1.0 or g == ALWAYS_DEEP):  # nan compares false
        raise ValueError(f"γ must be in [0, 1], or {ALWAYS_DEEP} for always deep")
    return float(g)


Gamma = Annotated[float, AfterValidator(check_gamma)]


def check_is_threshold(tau: float) -> float:
    """saar_is's τ: a positive finite ratio (IS ≥ τ replaces the failed turn; τ > 1 favours appending)."""
    if not 0 < tau < math.inf:  # nan compares false
        raise ValueError("the importance-ratio threshold τ must be a finite number > 0")
    return float(tau)


IsThreshold = Annotated[float, AfterValidator(check_is_threshold)]


def check_device(value: str) -> str:
    """Where a stage computes: auto (the GPU when torch sees one, else the CPU), cpu, cuda or cuda:N."""
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", value):
        raise ValueError("expected auto, cpu, cuda or cuda:N (N: the GPU's index)")
    return value


Device = Annotated[str, AfterValidator(check_device)]
# Where a stage runs, never what it computes: kept out of every config hash, checkpoint record and frozen run config,
# so a run started on one machine resumes on another.
PLACEMENT_SETTINGS = frozenset({"device"})


class Section(BaseModel):
    # a number that is inf or nan (`train.lr=inf`) is a mistake in every setting
    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, allow_inf_nan=False, coerce_numbers_to_str=True
    )  # `flow.run_id=20240601` is a name, not a number

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, value: Any, info) -> Any:
        # pydantic's lax mode reads `true` as 1: a boolean where a count or a number belongs is a mistake
        annotation = cls.model_fields[info.field_name].annotation
        if isinstance(value, bool) and _is_number(annotation):
            raise ValueError("expected a number, not a boolean")
        if isinstance(value, (list, tuple)) and any(isinstance(v, bool) for v in value) and _holds_numbers(annotation):
            raise ValueError("expected numbers, not booleans")
        return value

    @model_validator(mode="before")
    @classmethod
    def _empty_sections_are_defaults(cls, data: Any) -> Any:
        # a YAML section whose keys are all commented out reads as None: it means "the defaults"
        if isinstance(data, dict):
            return {
                k: v
                for k, v in data.items()
                if not (v is None and k in cls.model_fields and _is_section(cls.model_fields[k].annotation))
            }
        return data


def _is_section(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _is_number(annotation: Any) -> bool:
    """int or float, also inside Annotated[...] or Optional[...]."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _is_number(get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        kinds = [a for a in get_args(annotation) if a is not type(None)]
        return bool(kinds) and all(_is_number(a) for a in kinds)
    return annotation in (int, float)


def _holds_numbers(annotation: Any) -> bool:
    """A list or tuple of numbers, also inside Optional[...]."""
    origin = get_origin(annotation)
    if origin in (Union, types.UnionType):
        return any(_holds_numbers(a) for a in get_args(annotation) if a is not type(None))
    return origin in (list, tuple) and any(_is_number(a) for a in get_args(annotation))


class StorageConfig(Section):
    root: Path = Field(
        Path("workspace"),
        description=(
            "the workspace: runs, shards, checkpoints and the catalog (relative: to the directory a command runs in)"
        ),
    )
    catalog: str = Field("catalog.duckdb", description="the published DuckDB catalog file, under storage.root")
    rows_per_part: int = Field(50_000, gt=0, description="rows per Parquet part of a shard")
    compression: Literal["zstd", "snappy", "gzip", "brotli", "lz4", "none"] = Field(
        "zstd", description=("Parquet codec of the shards written (pyarrow's names)")
    )


class WorldConfig(Section):
    """The arithmetic tool-use world (tasks the tiny policy solves with Python)."""

    digits_min: int = Field(2, ge=1, description="fewest digits of a task's numbers")
    digits_max: int = Field(4, ge=1, description="most digits of a task's numbers")
    operands_min: int = Field(2, ge=2, description="fewest operands of a task's expression")
    operands_max: int = Field(3, ge=2, description="most operands of a task's expression")
    ops: list[Literal["+", "-", "*", "//", "%"]] = Field(["+", "-", "*"], description="operators the expressions use")
    two_step_fraction: float = Field(
        0.2,
        ge=0.0,
        le=1.0,
        description="share of tasks worded in two steps (the expression, then one more operation with another number)",
    )
    eval_size: int = Field(
        200, gt=0, description="held-out world tasks (`cleaner eval --world`, flow.eval_tasks=world)"
    )
    eval_seed: int = Field(1234, description="seed of the held-out tasks (another seed: another held-out set)")

    @model_validator(mode="after")
    def _ranges_in_order(self) -> "WorldConfig":
        for low, high in (("digits_min", "digits_max"), ("operands_min", "operands_max")):
            if getattr(self, low) > getattr(self, high):
                raise ValueError(
                    f"world.{low} ({getattr(self, low)}) must be at most world.{high} ({getattr(self, high)})"
                )
        return self


class SandboxConfig(Section):
    workers: int = Field(2, ge=1, description="sandbox worker processes: tool calls run at once")
    timeout_s: float = Field(
        4.0, gt=0, description="wall time of one tool call before it is killed (a timeout is a model error)"
    )
    memory_mb: int = Field(256, ge=32, description="address-space limit of one tool call")
    max_processes: int = Field(16, ge=1, description="processes one tool call may run")
    max_file_mb: int = Field(16, ge=1, description="largest file one tool call may write")
    output_chars: int = Field(
        1000, ge=16, description="stdout/stderr characters a tool call's output is cut to in the sandbox"
    )
    response_chars: int = Field(
        256, ge=16, description="characters of a tool result the model is shown (middle-truncated)"
    )
    infra_retries: int = Field(
        2, ge=0, description="reruns of a call the sandbox itself failed (an infrastructure error, never the model's)"
    )


# validation context of a config read back from what a run recorded (run.json, a shard's manifest): it is read as
# it was lived, whatever later rules a new config must follow
RECORD = {"record": True}


def inert(section: BaseModel, info: ValidationInfo, prefix: str, name: str, applies: bool, needs: str) -> None:
    """Refuse a setting given another value than its default where nothing reads it: a user who sets it expects
    it to change the run, and it would not. A record (RECORD) is read as it stands."""
    value, default = getattr(section, name), type(section).model_fields[name].default
    if not applies and value != default and not (info.context or {}).get("record"):
        shown = list(value) if isinstance(value, tuple) else value
        raise ValueError(
            f"{prefix}.{name}={shown} has no effect without {needs}: set that too, or leave {prefix}.{name} out"
        )


class SaarConfig(Section):
    gate_p: float = Field(
        1.0,
        ge=0.0,
        le=1.0,
        description=(
            "share of trajectories SAAR retries in (a coin per trajectory); the others keep every error, no retry"
        ),
    )
    max_retries: int = Field(3, ge=0, description="K: retries per position")
    gamma_live: Gamma = Field(
        0.5, description="γ of the live splice (rollback=similarity): similarity ≥ γ is shallow, below deep"
    )
    live_mode: Literal["purified", "raw"] = Field(
        "purified",
        description=(
            "what the model continues from after a retry: the spliced (purified) context, or everything as sampled "
            "(raw)"
        ),
    )
    safety_cap: int = Field(
        30,
        ge=1,
        description=("SAAR off once a trajectory has made more than this many tool executions (the reference's 30)"),
    )
    similarity: Literal["rapidfuzz", "difflib"] = Field(
        "rapidfuzz",
        description=(
            "shallow/deep measure: rapidfuzz (optimal LCS) or difflib (the reference's SequenceMatcher ratio); "
            "docs/saar.md"
        ),
    )
    similarity_on: Literal["segment", "code"] = Field(
        "segment",
        description=("compare the whole call segment (the reference) or only the code arguments; docs/saar.md"),
    )
    rollback: Literal["similarity", "importance"] = Field(
        "similarity",
        description=(
            "live_mode=purified: how a retry joins the lived sequence. similarity: SAAR's shallow/deep splice at "
            "gamma_live; importance: Open-CLEANER's Plan B, the retry replaces the failed turn when its importance "
            "ratio π(retry | without the failed turn) / π_b(retry | as sampled) is ≥ is_threshold, else the failed "
            "turn, its error and the retry all stay (a scoring forward per rollback, batched with the others pending; "
            "purify mode saar_is at the same τ relives it)"
        ),
    )
    is_threshold: IsThreshold = Field(0.5, description="τ of rollback=importance")

    @model_validator(mode="after")
    def _settings_that_apply(self, info: ValidationInfo) -> "SaarConfig":
        # the agent reads rollback only for a purified live sequence, and is_threshold only for rollback=importance
        inert(self, info, "rollout.saar", "rollback", self.live_mode == "purified", "rollout.saar.live_mode=purified")
        inert(
            self,
            info,
            "rollout.saar",
            "is_threshold",
            self.live_mode == "purified" and self.rollback == "importance",
            "rollout.saar.rollback=importance with rollout.saar.live_mode=purified",
        )
        return self


class EngineTuning(Section):
    """How the rollout's engine and scheduler run (`rollout.engine_tuning`): speed, memory and the batching
    schedule. The defaults are what every committed run used; a run changes them only to go faster on other
    hardware or with slower tools (benchmarks/RESULTS.md, async rollout)."""

    threads: int = Field(
        1,
        ge=1,
        description=(
            "torch threads of the CPU engine and the CPU trainer. Treated as speed only (a run resumes at another "
            "count), but a count changes float rounding: log-probs differ by ~1e-6 and a sampled token can flip, so "
            "results are bit-identical only at one count"
        ),
    )
    deterministic: bool = Field(
        True,
        description=(
            "fixed batching schedule (a tool result rejoins tool_delay_steps engine steps after its call), "
            "so reruns are bit-identical; false: results rejoin as they arrive (faster with slow tools)"
        ),
    )
    tool_delay_steps: int = Field(
        4,
        ge=1,
        description=(
            "deterministic schedule: engine steps between a call and its result; a result not back by then stalls the "
            "engine, so with slow tools raise it (benchmarks/RESULTS.md, async rollout); 4 keeps the committed "
            "experiments' schedule"
        ),
    )
    tool_priority: Literal["most_calls", "fifo"] = Field(
        "most_calls",
        description=(
            "free schedule: which waiting tool call gets the next free sandbox worker. most_calls: the one from the "
            "trajectory that has made the most calls (a rollout ends with its longest chain; benchmarks/RESULTS.md, "
            "async rollout); fifo: first made. The deterministic schedule always "
            "starts calls in the order they fall due"
        ),
    )
    kv_cache_tokens: int = Field(
        200_000,
        ge=0,
        description=(
            "CPU engine: tokens of KV kept for trajectories between their turns (least recently used evicted first)"
        ),
    )
    max_in_flight: int = Field(
        64,
        ge=1,
        description=(
            "SGLang and vLLM: concurrent generation requests; every engine: the most samples per task "
            "`cleaner eval --samples` batches"
        ),
    )
    vllm_start_timeout_s: float = Field(
        600.0, gt=0, description="engine=vllm: how long a started server may take to answer"
    )


# rollout.* keys that rollout.engine_tuning holds (a config or frozen run that names them at the top of rollout is
# read as if under engine_tuning, or refused with where they went)
MOVED_TO_ENGINE_TUNING = (
    "threads",
    "deterministic",
    "tool_delay_steps",
    "tool_priority",
    "kv_cache_tokens",
    "max_in_flight",
    "vllm_start_timeout_s",
)


class RolloutConfig(Section):
    policy: Path = Field(
        DEFAULT_POLICY,
        description="the checkpoint iteration 0 rolls out from (a folder with config.json, weights and tokenizer)",
    )
    engine: Literal["cpu", "sglang", "vllm"] = Field(
        "cpu",
        description=(
            "what samples: cpu (transformers here), sglang (rollout.sglang_url) or vllm (rollout.vllm_urls, or servers "
            "cleaner starts)"
        ),
    )
    tasks: str = Field(
        "world",
        description=(
            "what the rollout solves: 'world' (the arithmetic tool-use world) or a task Parquet file (docs/eval.md's "
            "layouts)"
        ),
    )
    tasks_per_iteration: int = Field(16, gt=0, description="prompts rolled out per iteration")
    samples_per_prompt: int = Field(4, gt=0, le=4096, description="trajectories per prompt: the GRPO group")
    temperature: float = Field(1.0, ge=0.0, description="sampling temperature (0: greedy)")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling (the vLLM engine needs 1.0)")
    max_turns: int = Field(16, gt=0, description="assistant turns per trajectory")
    max_tool_turns: int = Field(16, gt=0, description="tool calls per trajectory")
    max_turn_tokens: int = Field(160, gt=0, description="tokens one assistant turn may generate")
    max_response_tokens: int = Field(
        1024, gt=0, description="tokens of a whole response after the prompt (turns and tool results)"
    )
    max_prompt_tokens: int = Field(
        256, gt=0, description="longest prompt rolled out (a longer one is not; `cleaner eval` refuses it)"
    )
    overlong_buffer: int = Field(
        0, ge=0, description="DAPO soft overlong punishment over the last N response tokens (0 = off)"
    )
    answer_match: Literal["equivalent", "exact"] = Field(
        "equivalent",
        description=(
            "how a math or GPQA answer (the last \\boxed{} in the response's final 100 characters) must match the "
            "ground truth: equivalent, math-verify's equivalence (0.5 = \\frac12, x=3 = 3, 50\\% = 50; GPQA letters "
            "with (…) or \\text{} around them); exact, the CLEANER paper's scorer (verl's math_dapo, strict box): the "
            "box's text as written equals the ground truth's string. For numbers comparable with the paper's, use "
            "exact (docs/eval.md)"
        ),
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description=(
            "extra variables for the checkpoint's chat template, as verl's apply_chat_template_kwargs "
            "(e.g. {enable_thinking: false} for Qwen3): the prompt and the turn opened after every tool result are "
            "rendered with them"
        ),
    )
    malformed_call: Literal["no_call", "failure"] = Field(
        "no_call",
        description=(
            "an unclosed or unrepairable <tool_call>: no_call = the turn is final (the reference); failure = a failed "
            "call, shown to the model and retried"
        ),
    )
    seed: int = Field(0, description="sampling seed of the run")
    saar: SaarConfig = SaarConfig()
    sandbox: SandboxConfig = SandboxConfig()
    sglang_url: str = Field("http://127.0.0.1:30000", description="engine=sglang: the SGLang server")
    vllm_urls: list[str] = Field(
        default_factory=list,
        description=(
            "engine=vllm (and purify.recompute=vllm): OpenAI-compatible vLLM servers to use, each trajectory pinned to "
            "one (started with VLLM_SERVER_DEV_MODE=1 so each iteration's checkpoint can be loaded); empty: cleaner "
            "starts vllm_servers servers on 127.0.0.1 in vllm_venv, stopped with the command"
        ),
    )
    vllm_servers: int = Field(1, ge=1, description="engine=vllm without vllm_urls: servers cleaner starts")
    vllm_venv: Path | None = Field(
        None,
        description=(
            "engine=vllm without vllm_urls: the virtualenv holding vLLM (None: this checkout's .venv-vllm, which "
            "scripts/setup_vllm.sh builds)"
        ),
    )
    vllm_dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field(
        "float32", description="engine=vllm without vllm_urls: the dtype the started servers run the policy in"
    )
    vllm_args: list[str] = Field(
        ["--enforce-eager"],
        description=(
            "engine=vllm without vllm_urls: extra server arguments (--enforce-eager skips vLLM's compile, for a faster "
            "start; --block-size 32 raises prefix reuse; figures in benchmarks/RESULTS.md, vllm)"
        ),
    )
    engine_tuning: EngineTuning = EngineTuning()
    device: Device = Field(
        "auto",
        description=(
            "engine=cpu: where the engine (its model, KV cache and per-row random generators) runs: auto (the GPU when "
            "torch sees one, else the CPU), cpu, cuda or cuda:N"
        ),
    )

    @model_validator(mode="after")
    def _an_iteration_that_fits_in_memory(self) -> "RolloutConfig":
        # an iteration's trajectories are planned in memory: 1.6e9 of them was a MemoryError after the model loaded,
        # and tasks_per_iteration=1e12 a silent hang
        rows = self.tasks_per_iteration * self.samples_per_prompt
        if rows > MAX_ITERATION_TRAJECTORIES:
            raise ValueError(
                f"tasks_per_iteration × samples_per_prompt = {rows:,} trajectories an iteration, more than "
                f"{MAX_ITERATION_TRAJECTORIES:,}: a typo? (a large RL iteration is ~10^4)"
            )
        return self


# purify.* settings that choose where or which partitions are written, never what a partition holds:
# a run may change them between invocations (replay under more γ or another measure, another runner),
# and they stay out of the partitions' config hash (purifier/stage.py) and the frozen run config
# (flows/run_config.py).
# ("similarity", "similarity_on": purify keys merged into rollout.saar, which a frozen run.json may hold)
PURIFY_REPLAY_SETTINGS = (
    frozenset(
        {"modes", "gammas", "is_thresholds", "runner", "dask_address", "beam_options", "similarity", "similarity_on"}
    )
    | PLACEMENT_SETTINGS
)
# purify.* settings that change what one mode's partitions hold and nothing else: each is hashed into that
# mode's partitions only (purifier/stage.py), so partitions of the other modes committed before the setting
# existed keep their config hash and stay valid.
PURIFY_MODE_SETTINGS = frozenset({"roc_group_size"})


class PurifyConfig(Section):
    # at least one each: an empty list purified nothing and said so nowhere
    modes: list[Mode] = Field(
        ["saar", "raw"],
        min_length=1,
        description=(
            "purification modes written each iteration, one partition each (docs/saar.md); train.mode's is added"
        ),
    )
    gammas: list[Gamma] = Field(
        [0.5],
        min_length=1,
        description=("γ of the similarity modes (saar, saar_correct), one partition each; train.gamma's is added"),
    )
    is_thresholds: list[IsThreshold] = Field(
        [0.5],
        min_length=1,
        description=(
            "mode saar_is (Open-CLEANER's Plan B): a retry replaces the failed turn when its importance ratio "
            "π(retry | context without the failed turn) / π_b(retry | as sampled) is ≥ τ, else both stay; one "
            "partition per τ (tau=0.50)"
        ),
    )
    advantage: Literal["group_norm", "dr_grpo"] = Field(
        "group_norm",
        description="GRPO advantage: group_norm ((r − mean) / (std + 1e-6) in the prompt group, population std) "
        "or dr_grpo (r − mean)",
    )
    dynamic_filter: bool = Field(
        False, description="DAPO dynamic sampling: drop prompt groups whose rewards are all equal (no learning signal)"
    )
    recompute: Literal["cpu", "sglang", "vllm"] = Field(
        "cpu",
        description=(
            "old log-probs after a splice: cpu (transformers, prefix KV reuse), sglang (prefill at rollout.sglang_url) "
            "or vllm (prefill with prompt_logprobs on the rollout's vLLM servers, rollout.vllm_*)"
        ),
    )
    runner: str = Field(
        "FnApiRunner",
        description=(
            "Beam runner: FnApiRunner (in-process), dask (Beam's DaskRunner on the cluster at purify.dask_address; "
            "docs/scale_out.md), or any runner Beam accepts, with its options in purify.beam_options"
        ),
    )
    beam_options: list[str] = Field(
        [], description="Beam pipeline options for purify.runner, e.g. --flink_master=HOST:8081"
    )
    dask_address: str | None = Field(
        None,
        description=(
            "runner=dask: the Dask scheduler, e.g. tcp://10.0.0.5:8786 (None: the local cluster that "
            "`cleaner cluster start` runs for this storage root)"
        ),
    )
    max_dead_letter_fraction: float = Field(
        0.05,
        ge=0.0,
        le=1.0,
        description="share of rows purification may set aside as dead letters before the stage fails",
    )
    roc_group_size: int | None = Field(
        None,
        ge=1,
        description=(
            "mode roc: rows kept per prompt group (None: half of rollout.samples_per_prompt, at least 1); at most "
            "rollout.samples_per_prompt"
        ),
    )
    device: Device = Field(
        "auto",
        description=(
            "recompute=cpu: where the log-prob recompute (transformers) runs, in each process that runs it (a Dask "
            "worker's own GPU under auto): auto (the GPU when torch sees one, else the CPU), cpu, cuda or cuda:N"
        ),
    )

    @field_validator("dask_address")
    @classmethod
    def _scheduler_address(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"([a-z]+://)?[^\s/:]+:\d{1,5}", value):
            raise ValueError("expected a Dask scheduler address like tcp://HOST:8786")
        return value


class TrainConfig(Section):
    mode: Mode = Field("saar", description="the purification mode the update trains on")
    gamma: Gamma = Field(
        0.5,
        description=(
            "SAAR's similarity threshold γ of the partition the update trains on when train.mode is saar or "
            "saar_correct (mode=saar/gamma=0.50); the flow purifies it"
        ),
    )
    tau: IsThreshold = Field(
        0.5,
        description=(
            "the importance-ratio threshold τ of the partition the update trains on when train.mode=saar_is "
            "(train.tau=0.3 trains on mode=saar_is/tau=0.30); the flow purifies it"
        ),
    )
    strategy: Literal["local", "deepspeed"] = Field(
        "local",
        description=(
            "local: one process (CPU or one GPU); deepspeed: OpenRLHF DeepspeedStrategy (ZeRO), one rank per "
            "process under torchrun (gloo on CPU)"
        ),
    )
    zero_stage: Literal[2, 3] = Field(2, description="ZeRO stage for strategy=deepspeed")
    nproc: int = Field(1, ge=1, description="ranks torchrun starts for strategy=deepspeed (GPUs per node)")
    param_dtype: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32",
        description=(
            "training precision. fp32: everything in float32 (TF32 matmuls on a GPU). bf16: mixed precision; "
            "strategy=local runs the forward and backward under torch.autocast(bfloat16) while the weights, their "
            "gradients and AdamW's moments stay float32; strategy=deepspeed (DeepSpeed's bf16 mode through OpenRLHF) "
            "holds the model's weights and each micro-batch's gradients in bfloat16 and keeps float32 master weights, "
            "float32 gradient accumulation (OpenRLHF's grad_accum_dtype) and float32 AdamW moments in the ZeRO "
            "partitions. fp16: strategy=deepspeed on a GPU only (DeepSpeed's fp16 mode with its dynamic loss scale). "
            "Log-probs are float32 softmaxes over the logits in every mode; docs/scale_out.md"
        ),
    )
    device: Device = Field(
        "auto",
        description=(
            "strategy=local: where the update runs: auto (the GPU when torch sees one, else the CPU), cpu, cuda or "
            "cuda:N; strategy=deepspeed: auto or cuda puts each rank on its own GPU (LOCAL_RANK, NCCL), cpu trains on "
            "the CPU over gloo"
        ),
    )
    gradient_checkpointing: bool = Field(
        False,
        description=(
            "activation checkpointing: each decoder layer's activations are recomputed in backward instead of kept "
            "(transformers' gradient_checkpointing_enable, non-reentrant), for long trajectories on a GPU's memory"
        ),
    )
    offload_optimizer: bool = Field(
        False,
        description=(
            "strategy=deepspeed: keep the ZeRO optimizer's float32 master weights and AdamW moments in CPU memory "
            "(OpenRLHF's adam_offload; the step runs torch's AdamW on the CPU, nothing compiled at run time)"
        ),
    )
    fresh_optimizer: bool = Field(
        False,
        description=(
            "continue from a checkpoint whose optimizer state this update cannot read (written by another "
            "train.strategy, train.nproc or train.zero_stage) with a fresh AdamW and LR warm-up; false: such an "
            "update is refused in one line"
        ),
    )
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = Field(
        "sdpa",
        description=(
            "the update's attention: sdpa (torch's scaled_dot_product_attention: flash/memory-efficient kernels where "
            "torch has them), eager, or flash_attention_2 (the flash_attn package's CUDA kernels, on a GPU)"
        ),
    )
    lr: float = Field(1e-4, gt=0, description="AdamW learning rate")
    warmup_steps: int = Field(2, ge=0, description="optimizer steps of linear learning-rate warm-up")
    weight_decay: float = Field(0.01, ge=0, description="AdamW weight decay")
    grad_clip: float = Field(1.0, gt=0, description="gradient norm clip")
    clip_eps_low: float = Field(0.2, ge=0, description="PPO clip below: ratio ≥ 1 − this")
    clip_eps_high: float = Field(0.28, ge=0, description="PPO clip above: ratio ≤ 1 + this (DAPO clip-higher)")
    dual_clip: float | None = Field(
        10.0,
        gt=1.0,
        description=(
            "dual-clip PPO's bound on the ratio for negative advantages (OpenRLHF's dual_clip; > 1), None: off"
        ),
    )
    policy_loss_type: Literal["ppo", "gspo"] = Field(
        "ppo", description="OpenRLHF's policy loss: ppo (token ratios) or gspo (sequence ratios)"
    )
    loss_agg: Literal["token_mean", "seq_mean"] = Field(
        "token_mean",
        description=(
            "how policy_loss_type=ppo's per-token losses become the mini-batch loss (OpenRLHF's token_level_loss): "
            "token_mean (every trained token of the mini-batch weighs the same; DAPO) or seq_mean (each row's mean "
            "over its trained tokens, then the mean over rows: GRPO's original normalisation, which weighs a long "
            "row's tokens less)"
        ),
    )
    epochs: int = Field(1, ge=1, description="passes over the purified shard per update")
    mini_batches: int = Field(
        2, ge=1, description="optimizer steps per epoch: the shard's prompt groups split into this many"
    )
    micro_batch_tokens: int = Field(
        8192,
        gt=0,
        description="tokens per forward/backward (rows packed by length; gradients accumulated per mini-batch)",
    )
    log_entropy: bool = Field(False, description="log the policy entropy per step (one more pass over the vocabulary)")
    seed: int = Field(0, description="seed of the update (dropout, ordering)")
    rollout_correction: Literal["off", "token_tis", "token_mis", "seq_mis", "geo_rs"] = Field(
        "off",
        description=(
            "train-time correction for tokens trained in another context than they were sampled in: verl's presets on "
            "OpenRLHF's PolicyLoss gate over pi_old/pi_behaviour (the purified rows' behaviour_logprobs). token_tis: "
            "token weights truncated at 2 (verl decoupled_token_is); token_mis: tokens outside [0.5, 5] masked "
            "(IcePop, verl decoupled_token_icepop); seq_mis: rows whose per-token geometric-mean ratio is outside "
            "[0.5, 2] masked (verl's sequence MIS band, gated on OpenRLHF's geometric mean); geo_rs: the same gate at "
            "[0.999, 1.001] (verl decoupled_geo_rs). trainer/correction.py; saar + token_tis is the reference's Plan C"
        ),
    )
    rollout_correction_bounds: tuple[float, float] | None = Field(
        None, description=("[lower, upper] on the gated ratio, replacing the preset's (None: the preset's own)")
    )
    use_dpo_on_tool_calls: bool = Field(
        False,
        description=(
            "negative-sample DPO side loss (the reference's option; its paper reports it destabilised training): each "
            "failed call and the working retry at its position, scored in the failed call's context, from the raw shard"
        ),
    )
    dpo_beta: float = Field(
        15.0, gt=0, description="DPO beta on the length-normalised call log-prob gap (reference recipe: 15)"
    )
    dpo_max_adjustment_ratio: float = Field(
        0.1,
        gt=0,
        description=(
            "cap on the DPO side loss's per-token weight, as the reference caps its per-token advantage adjustment"
        ),
    )

    @field_validator("rollout_correction_bounds")
    @classmethod
    def _bounds_in_order(cls, value: tuple[float, float] | None) -> tuple[float, float] | None:
        if value is None:
            return value
        lower, upper = value
        if not (math.isfinite(lower) and math.isfinite(upper)):
            raise ValueError(f"bounds must be finite numbers, got [{lower}, {upper}]")
        if lower < 0 or lower >= upper:
            raise ValueError(f"expected 0 <= lower < upper on the importance ratio, got [{lower}, {upper}]")
        return value

    @model_validator(mode="after")
    def _tau_for_saar_is(self) -> "TrainConfig":
        # γ given where a τ is wanted, and no τ: the threshold meant for the partition would be silently ignored
        if self.mode in IS_MODES and "gamma" in self.model_fields_set and "tau" not in self.model_fields_set:
            raise ValueError(
                f"train.gamma is SAAR's similarity threshold γ, which train.mode={self.mode} does not "
                f"use: give its importance-ratio threshold as train.tau (e.g. train.tau={self.gamma:g})"
            )
        return self

    @model_validator(mode="after")
    def _offload_needs_deepspeed(self) -> "TrainConfig":
        if self.offload_optimizer and self.strategy != "deepspeed":
            raise ValueError(
                "train.offload_optimizer=true is ZeRO's optimizer offload: it needs train.strategy=deepspeed"
            )
        if self.param_dtype == "fp16" and self.strategy == "local":
            raise ValueError(
                "train.param_dtype=fp16 needs a loss scale, which strategy=local does not keep: use "
                "train.param_dtype=bf16, or train.strategy=deepspeed (DeepSpeed's dynamic loss scale)"
            )
        return self

    @model_validator(mode="after")
    def _settings_that_apply(self, info: ValidationInfo) -> "TrainConfig":
        correcting = self.rollout_correction != "off"
        inert(self, info, "train", "rollout_correction_bounds", correcting, "a train.rollout_correction preset")
        for name in ("dpo_beta", "dpo_max_adjustment_ratio"):
            inert(self, info, "train", name, self.use_dpo_on_tool_calls, "train.use_dpo_on_tool_calls=true")
        for name in ("nproc", "zero_stage"):  # the local strategy is one process without ZeRO
            inert(self, info, "train", name, self.strategy == "deepspeed", "train.strategy=deepspeed")
        return self

    @model_validator(mode="after")
    def _correction_needs_ppo(self) -> "TrainConfig":
        if self.loss_agg != "token_mean" and self.policy_loss_type != "ppo":
            raise ValueError(
                f"train.loss_agg={self.loss_agg} applies to train.policy_loss_type=ppo (OpenRLHF's "
                f"{self.policy_loss_type} loss aggregates per sequence already)"
            )
        if self.rollout_correction != "off" and self.policy_loss_type != "ppo":
            raise ValueError(
                f"train.rollout_correction={self.rollout_correction} needs train.policy_loss_type=ppo "
                f"(OpenRLHF's {self.policy_loss_type} loss does not apply the correction gate)"
            )
        return self


# Settings hashed into a section's hash only when not at their default: an output committed before they existed was
# made as their default makes it, and keeps its identity.
SECTION_SETTINGS_IF_SET = {"rollout": {"answer_match": "equivalent"}}

# train.* settings hashed into train_settings only when not at their default: a checkpoint recorded before they
# existed was trained as their defaults train, and keeps its record.
TRAIN_SETTINGS_IF_SET = {
    "gradient_checkpointing": False,
    "fresh_optimizer": False,
    "offload_optimizer": False,
    "attn_implementation": "sdpa",
    "loss_agg": "token_mean",
}


def hashed_train_settings(train: TrainConfig) -> dict[str, Any]:
    """The train settings that decide what an update computes (its placement left out). The threshold of the
    partition trained on is recorded under `gamma` for every mode, τ for the importance-ratio modes: one record
    format for every checkpoint, those of importance-ratio runs frozen with their τ in train.gamma among them."""
    settings = train.model_dump(mode="json", exclude=set(PLACEMENT_SETTINGS) | {"tau"})
    if train.mode in IS_MODES:
        settings["gamma"] = train.tau
    return {k: v for k, v in settings.items() if k not in TRAIN_SETTINGS_IF_SET or v != TRAIN_SETTINGS_IF_SET[k]}


def upgrade_frozen(data: dict[str, Any]) -> dict[str, Any]:
    """A config tree as run.json froze it, as this cleaner names it: a train section without `tau` holds an
    importance-ratio mode's τ in `gamma` (γ then is at its default). Every reader of a frozen config reads it through
    this (the flow's comparison with it, gc, export, report)."""
    train = data.get("train")
    if not isinstance(train, dict) or "tau" in train or train.get("mode") not in IS_MODES or "gamma" not in train:
        return data
    gamma = TrainConfig.model_fields["gamma"].default
    return {**data, "train": {**train, "gamma": gamma, "tau": train["gamma"]}}


def train_settings(train: TrainConfig) -> str:
    """What a checkpoint records of the update that trained it: a rerun with other settings is refused."""
    return hashlib.blake2b(json.dumps(hashed_train_settings(train), sort_keys=True).encode(), digest_size=8).hexdigest()


class FlowConfig(Section):
    run_id: str = Field("demo", description="the run: runs/<run_id> under storage.root")

    @field_validator("run_id")
    @classmethod
    def _plain_run_id(cls, v: str) -> str:
        from storage.layout import run_id_problem

        problem = run_id_problem(v)
        if problem:
            raise ValueError(problem)
        return v

    iterations: int = Field(
        3,
        ge=1,
        description=(
            "iterations a training flow trains (a rerun resumes them; a schedule's firing trains this many more)"
        ),
    )
    task_retries: int = Field(
        1, ge=0, description="Prefect retries of a failed stage task (a user error is never retried)"
    )
    replay_gammas: list[Gamma] = Field(
        [0.3, 0.5, 0.7],
        min_length=1,
        description="γ values `cleaner replay` (and the demo's replay) purifies by default",
    )
    tensorboard: bool = Field(False, description="also write per-iteration metrics to runs/<run>/tensorboard")
    wandb_project: str | None = Field(None, description="also log per-iteration metrics to this W&B project")
    eval_every: int = Field(
        0,
        ge=0,
        description=(
            "evaluate checkpoint i (the policy iteration i rolls out from) when i is a multiple of this, and the "
            "last one, as a Prefect task before iteration i's rollout; metrics in the run's metrics shard, stage=eval "
            "(0 = off; docs/eval.md)"
        ),
    )
    eval_tasks: str = Field("world", description="held-out tasks of that evaluation: 'world' or a task file")
    eval_samples: int = Field(1, ge=1, description="samples per task of that evaluation (avg@k, pass@k)")
    eval_limit: int | None = Field(None, ge=1, description="only the first N tasks of eval_tasks")
    eval_saar_off: bool = Field(True, description="also evaluate with SAAR off at test time (beside SAAR on)")


class CleanerConfig(Section):
    storage: StorageConfig = StorageConfig()
    world: WorldConfig = WorldConfig()
    rollout: RolloutConfig = RolloutConfig()
    purify: PurifyConfig = PurifyConfig()
    train: TrainConfig = TrainConfig()
    flow: FlowConfig = FlowConfig()

    @model_validator(mode="after")
    def _roc_group_fits(self) -> "CleanerConfig":
        size = self.purify.roc_group_size
        if size is not None and size > self.rollout.samples_per_prompt:
            raise ValueError(
                f"purify.roc_group_size ({size}) must be at most rollout.samples_per_prompt "
                f"({self.rollout.samples_per_prompt}): RoC down-samples each prompt's group"
            )
        return self

    @model_validator(mode="after")
    def _groups_for_every_rank(self, info: ValidationInfo) -> "CleanerConfig":
        # each DeepSpeed rank trains whole prompt groups of every mini-batch (trainer/deepspeed_update.py): a
        # mini-batch of fewer groups than ranks fails at the update, after the rollout and purification it costs
        t = self.train
        if t.strategy != "deepspeed" or t.nproc == 1 or (info.context or {}).get("record"):
            return self
        groups = self.rollout.tasks_per_iteration
        n = max(1, min(t.mini_batches, groups))
        size = -(-groups // n)  # trainer.batches.mini_batches: whole groups, the last mini-batch the smallest
        smallest = groups - size * ((groups - 1) // size)
        if smallest < t.nproc:
            raise ValueError(
                f"train.nproc={t.nproc} ranks, but a mini-batch holds {smallest} prompt group(s) "
                f"(rollout.tasks_per_iteration={groups} over train.mini_batches={t.mini_batches}): each rank "
                f"trains whole groups; use train.mini_batches={max(1, groups // t.nproc)} or fewer, or fewer ranks"
            )
        return self

    @model_validator(mode="after")
    def _vllm_scores_at_temperature_one(self) -> "CleanerConfig":
        # vLLM's prompt log-probs (what it scores a given sequence with) are of the raw logits: at another
        # temperature every recompute, or a live importance ratio, would fail mid-run, when a row first needs one
        t = self.rollout.temperature
        if t in (0.0, 1.0):
            return self
        live_is = (
            self.rollout.engine == "vllm"
            and self.rollout.saar.rollback == "importance"
            and self.rollout.saar.live_mode == "purified"
        )
        if self.purify.recompute == "vllm":
            raise ValueError(
                f"purify.recompute=vllm scores with vLLM's prompt log-probs, which are of the raw logits: "
                f"it needs rollout.temperature=1.0 (got {t:g}); score on the CPU (purify.recompute=cpu)"
            )
        if live_is:
            raise ValueError(
                f"rollout.saar.rollback=importance on rollout.engine=vllm scores with vLLM's prompt "
                f"log-probs, which are of the raw logits: it needs rollout.temperature=1.0 (got {t:g})"
            )
        return self

    def section_hash(self, *sections: str) -> str:
        """Stable hash of the named sections: what a stage's manifest records as its config."""
        data = {s: getattr(self, s).model_dump(mode="json", exclude=set(PLACEMENT_SETTINGS)) for s in sections}
        for section, defaults in SECTION_SETTINGS_IF_SET.items():
            for key, default in defaults.items():
                if section in data and data[section].get(key) == default:
                    del data[section][key]
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def roc_group_size(cfg: CleanerConfig) -> int:
    """Rows mode roc keeps per prompt group: purify.roc_group_size, by default half the samples per prompt
    (RoC samples twice the group it trains on)."""
    return cfg.purify.roc_group_size or max(1, cfg.rollout.samples_per_prompt // 2)


class ConfigError(CleanerError, ValueError):
    """A config file or override that does not fit the tree; the message names the key."""

    exit_code = 2  # like argparse's refusals: the command line or its config is wrong


def _known_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        keys.append(prefix + name)
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys.extend(_known_keys(ann, prefix + name + "."))
    return keys


# Keys earlier configs had: an old YAML or override naming one gets what became of it, not a guess.
_GONE_KEYS = {
    "rollout.loop": "removed: every rollout runs the asynchronous loop (the lockstep one is a benchmark baseline "
    "now, benchmarks/lockstep_engine.py); delete the key",
    **{f"rollout.{key}": f"moved to rollout.engine_tuning.{key}" for key in MOVED_TO_ENGINE_TUNING},
    **{
        f"purify.{key}": f"merged into rollout.saar.{key} (one measure setting): a replay with another "
        f"rollout.saar.{key} is written beside the run's partitions, e.g. gamma=0.50-difflib-segment"
        for key in ("similarity", "similarity_on")
    },
}


# The names verl, OpenRLHF and TRL users type for a setting, by the last part of the key
_ALIASES = {
    "learning_rate": "train.lr",
    "actor_learning_rate": "train.lr",
    "temp": "rollout.temperature",
    "n": "rollout.samples_per_prompt",
    "n_samples_per_prompt": "rollout.samples_per_prompt",
    "num_samples": "rollout.samples_per_prompt",
    "num_generations": "rollout.samples_per_prompt",
    "max_new_tokens": "rollout.max_turn_tokens",
    "response_length": "rollout.max_response_tokens",
    "max_response_length": "rollout.max_response_tokens",
    "max_prompt_length": "rollout.max_prompt_tokens",
    "prompt_max_len": "rollout.max_prompt_tokens",
    "generate_max_len": "rollout.max_response_tokens",
    "epochs": "train.epochs",
    "num_episodes": "flow.iterations",
    "total_epochs": "flow.iterations",
    "model": "rollout.policy",
    "pretrain": "rollout.policy",
    "model_name_or_path": "rollout.policy",
}


def _unknown_key(dotted: str) -> str:
    """`unknown config key 'a.b' (did you mean 'a.c'?)`: the same words for a YAML key and an override. The guess:
    a near spelling in its section, the same last part in another, a name other trainers use, the closest spelling."""
    if dotted in _GONE_KEYS:
        return f"config key {dotted!r} {_GONE_KEYS[dotted]}"
    known = _known_keys(CleanerConfig)
    leaf = dotted.rsplit(".", 1)[-1]
    section = dotted.rsplit(".", 1)[0] + "." if "." in dotted else ""
    close = (
        difflib.get_close_matches(dotted, [k for k in known if k.startswith(section)], n=1, cutoff=0.85)
        or [k for k in known if k.rsplit(".", 1)[-1] == leaf and k != dotted][:1]
        or ([_ALIASES[leaf]] if leaf in _ALIASES else [])
        or difflib.get_close_matches(dotted, [k for k in known if k.count(".") == dotted.count(".")], n=1)
    )
    return f"unknown config key {dotted!r}" + (f" (did you mean {close[0]!r}?)" if close else "")


class _Loader(yaml.SafeLoader):
    """YAML as the 1.2 core schema reads scalars, and a mapping may not name a key twice (PyYAML's SafeLoader lets
    the later one silently win: a second `rollout:` block would drop the first's settings). YAML 1.1's other
    readings would each change or refuse a value silently: `off`/`yes`/`on` as booleans, `010` as octal 8,
    `2024-06-01` as a date, while `2e5` stays a string; here they are text (which a boolean setting still reads as
    yes/no), 10, text, 200000.0."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} given twice (first at line {seen[key]})", key_node.start_mark
                )
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        text = self.construct_scalar(node).replace("_", "")
        return int(text, 0) if text.lstrip("+-")[:2].lower() in ("0x", "0o") else int(text, 10)


_Loader.yaml_implicit_resolvers = {}
for _tag, _pattern, _first in (
    ("bool", r"^(?:true|True|TRUE|false|False|FALSE)$", "tTfF"),
    ("int", r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$", "-+0123456789"),
    (
        "float",
        r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$",
        "-+0123456789.",
    ),
    ("null", r"^(?:~|null|Null|NULL|)$", ["~", "n", "N", ""]),
):
    _Loader.add_implicit_resolver(f"tag:yaml.org,2002:{_tag}", re.compile(_pattern), list(_first))
_Loader.add_constructor("tag:yaml.org,2002:int", _Loader.construct_yaml_int)


def read_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader


def apply_override(data: dict[str, Any], assignment: str) -> None:
    if "=" not in assignment:
        raise ConfigError(f"override {assignment!r} is not of the form section.key=value")
    dotted, raw = assignment.split("=", 1)
    dotted = dotted.strip()
    if dotted not in _known_keys(CleanerConfig):
        raise ConfigError(_unknown_key(dotted))
    *sections, key = dotted.split(".")
    node = data
    for i, section in enumerate(sections):
        if node.get(section) is None:  # absent, or a YAML section whose keys are all commented out
            node[section] = {}
        node = node[section]
        if not isinstance(node, dict):
            raise ConfigError(f"{'.'.join(sections[: i + 1])} is {node!r}, not a section: {dotted} cannot be set in it")
    try:
        node[key] = read_yaml(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(
            f"override {assignment!r}: not valid YAML ({_yaml_problem(e)}); quote lists, e.g. 'purify.gammas=[0.3,0.7]'"
        ) from None


def _yaml_problem(e: yaml.YAMLError) -> str:
    mark = getattr(e, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{getattr(e, 'problem', None) or e}{where}"


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> CleanerConfig:
    data: Any = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            data = read_yaml(p.read_text(encoding="utf-8")) or {}
        except UnicodeDecodeError as e:
            raise ConfigError(
                f"config file {p}: not UTF-8 text (byte {e.start}: {e.reason}); save it as UTF-8"
            ) from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {p}: not valid YAML ({_yaml_problem(e)})") from None
        except OSError as e:
            raise ConfigError(f"config file {p}: cannot be read ({e.strerror})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {p} must hold a mapping at the top level")
    for assignment in overrides:
        apply_override(data, assignment)
    try:
        return CleanerConfig.model_validate(data)
    except ValidationError as e:
        overridden = [a.split("=", 1)[0].strip() for a in overrides]
        by_source: dict[str, list[str]] = {}  # each error under where its value came from, in order
        for err in e.errors():
            by_source.setdefault(_blame(err["loc"], overridden, path), []).append(_describe(err))
        raise ConfigError(
            "; ".join(f"invalid config{where}: " + "; ".join(lines) for where, lines in by_source.items())
        ) from None


def _blame(loc: tuple, overridden: list[str], path: str | Path | None) -> str:
    """Where a wrong value came from, for its error's first words: the command line when an override set it
    (or a key under it), else the config file (else the defaults, which name nothing)."""
    dotted = ".".join(str(x) for x in loc)
    if any(dotted == key or dotted.startswith(key + ".") for key in overridden):
        return " on the command line"
    if path is None:
        # a check across keys (loc: the section holding them) that only overrides can have upset
        return " on the command line" if overridden else ""
    if any(key.startswith(dotted + ".") or not dotted for key in overridden):
        return f" in {path} with the command line's overrides"  # a check across keys, some set on each
    return f" in {path}"


def _describe(err: dict) -> str:
    """One pydantic error as `key: what is wrong (got value)`; a key the tree lacks as an override's would be."""
    dotted = ".".join(str(x) for x in err["loc"])
    if err["type"] == "extra_forbidden":
        return _unknown_key(dotted)
    return f"{dotted + ': ' if dotted else ''}{err['msg'].removeprefix('Value error, ')}" + (
        f" (got {err['input']!r})" if not isinstance(err["input"], dict) else ""
    )


def describe_config(cfg: BaseModel, prefix: str = "") -> list[str]:
    """Every setting as `key: value  # description` (the value as `cfg` has it), sections in order."""
    lines = []
    for name, field in type(cfg).model_fields.items():
        value = getattr(cfg, name)
        if isinstance(value, BaseModel):
            lines += describe_config(value, prefix + name + ".")
            continue
        shown = json.dumps(value.model_dump(mode="json") if isinstance(value, BaseModel) else value, default=str)
        lines.append(f"{prefix}{name}: {shown}" + (f"  # {field.description}" if field.description else ""))
    return lines


def dump_config(cfg: CleanerConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
