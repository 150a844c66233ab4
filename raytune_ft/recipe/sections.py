"""The recipe's sections (model, data, train, scaling, tracking, registry): typed fields with their
defaults, each section checking its own fields. `raytune_ft.recipe.recipe` puts them together into a `Recipe`
and re-exports them; import them from there."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from raytune_ft.recipe.values import RecipeError, check_range

_UC_PART = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_-]*$")
_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def validate_registry_name(name: str, path: str = "registry.name") -> None:
    parts = name.split(".")
    if len(parts) != 3 or not all(_UC_PART.match(p) for p in parts):
        raise RecipeError(
            f"{path}: {name!r} is not a three-level Unity Catalog name catalog.schema.model "
            "(each part letters, digits, '_' or '-', not starting with '-')")


@dataclass
class ModelConfig:
    name: str = "Qwen/Qwen3.8-27B"          # hub id, or a local folder with config.json
    revision: str | None = None              # pinned commit of the hub repo
    family: str = "qwen3_5"                  # qwen3_5 | qwen3 | qwen2
    tokenizer: str | None = None             # defaults to `name`
    local_tiny: bool = False                 # build a tiny model of `family` from a config (--local)
    # pretrained: read the checkpoint at name/revision. random: the architecture of `name` with a fresh
    # random init and no checkpoint read (benchmarks at the real shape, from-scratch runs); the config
    # comes from `name` (a folder or hub id), or offline from the project's copy of the recipe models.
    init: Literal["pretrained", "random"] = "pretrained"
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    trust_remote_code: bool = False
    max_position_embeddings: int | None = None  # read from the model config when None
    chat_template: str | None = None         # a jinja file to use instead of the tokenizer's own

    def validate(self) -> None:
        if not self.name.strip():
            raise RecipeError("model.name: must not be empty")
        if self.family not in ("qwen3_5", "qwen3", "qwen2"):
            raise RecipeError(f"model.family: {self.family!r} is not one of 'qwen3_5', 'qwen3', 'qwen2'")
        if self.revision is not None and not re.fullmatch(r"[0-9a-f]{7,40}|[A-Za-z0-9._/-]+", self.revision):
            raise RecipeError(f"model.revision: {self.revision!r} is not a commit hash or branch name")
        if self.chat_template is not None and not os.path.isfile(os.path.expanduser(self.chat_template)):
            raise RecipeError(f"model.chat_template: {self.chat_template!r} is not a file")


@dataclass
class DataConfig:
    # one source: hf://org/name, s3://bucket/prefix, a local jsonl/json/parquet file or folder (compressed
    # forms too), or builtin:chat; `sources` (a list) mixes several instead
    source: str = "hf://HuggingFaceH4/ultrachat_200k"
    revision: str | None = None
    split: str = "train_sft"                 # a hub dataset's (or a folder's) split; a single file is its own
    schema: Literal["auto", "messages", "sharegpt", "conversation", "alpaca", "prompt_completion"] = "auto"
    fields: dict[str, str] = field(default_factory=dict)        # a format's field -> the rows' name for it
    roles: dict[str, list[str]] = field(default_factory=dict)   # a chat role -> more names rows use for it
    # a mixture: [{source, split?, revision?, schema?, fields?, roles?, weight? (how often each row is used:
    # 0.5 a seeded half, 2 twice), max_rows?, validation_split?, validation_fraction?, name?}], interleaved by
    # `seed`
    sources: list[dict[str, Any]] = field(default_factory=list)
    mixture: str | None = None               # the name of one of `mixtures` (a job offers them) to train on
    mixtures: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    # held out of training by content hash (seeded); None: 0.05 when the run evaluates or samples held-out
    # rows and names no validation_split, else 0. A small local source holds out at least one row and at
    # most its share of validation_max_rows (a mixture's sources share it)
    validation_fraction: float | None = None
    # a separate split of the source for evaluation (a job's, for its own source only); training skips rows
    # with an evaluated row's content
    validation_split: str | None = None
    validation_max_rows: int | None = None   # evaluate on the first N held-out rows only (its cost: `raytune-ft plan`)
    max_skip_fraction: float = 0.05          # a run whose skipped rows pass this share stops, naming the reasons
    seed: int = 42
    seq_len: int = 32768                     # tokens per packed block
    max_rows: int | None = None              # read at most this many rows (smoke runs)
    pack_window: int = 2048                  # conversations held for best-fit-decreasing packing
    # a conversation over seq_len: "split" trains its pieces that hold an assistant token, "drop" skips it
    overlong: Literal["split", "drop"] = "split"
    # passed to the chat template; a key it never reads is said before the run and not passed (ignored)
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    num_cpus_per_op: float = 0.25            # fractional CPUs for Ray Data operators (no deadlock on small hosts)
    # processes tokenizing at once (None: one per training worker, at least 2); more replays a resumed
    # pass's consumed blocks faster on a node with cores to spare
    tokenize_workers: int | None = None

    def validate(self, model: ModelConfig) -> None:
        from raytune_ft.data.specs import check_specs

        if self.mixture is not None:
            if self.mixture not in self.mixtures:
                raise RecipeError(f"data.mixture: {self.mixture!r} is not one of this job's mixtures "
                                  f"({', '.join(self.mixtures) or 'it offers none'})")
            self.sources = [dict(s) for s in self.mixtures[self.mixture]]
        check_specs(self)
        check_range("data.seq_len", self.seq_len, 16, 1 << 20)
        if model.max_position_embeddings is not None and self.seq_len > model.max_position_embeddings:
            raise RecipeError(f"data.seq_len: {self.seq_len} exceeds the model context "
                              f"model.max_position_embeddings={model.max_position_embeddings}")
        if self.validation_fraction is not None:
            check_range("data.validation_fraction", self.validation_fraction, 0.0, 0.5)
        check_range("data.max_skip_fraction", self.max_skip_fraction, 0.0, 1.0)
        if self.max_rows is not None:
            check_range("data.max_rows", self.max_rows, 1)
        if self.validation_max_rows is not None:
            check_range("data.validation_max_rows", self.validation_max_rows, 1)
        check_range("data.pack_window", self.pack_window, 1, 1_000_000)
        check_range("data.num_cpus_per_op", self.num_cpus_per_op, 0.0, 64, lo_open=True)
        if self.tokenize_workers is not None:
            check_range("data.tokenize_workers", self.tokenize_workers, 1, 4096)

    def settle_held_out(self, reads_held_out: bool) -> None:
        """Resolve `validation_fraction=None`: 5% held out by content hash when the run reads held-out rows
        and no split is named, else none."""
        if self.validation_fraction is None:
            self.validation_fraction = DEFAULT_HELD_OUT if reads_held_out and not self.validation_split else 0.0


DEFAULT_HELD_OUT = 0.05


# every linear of both Qwen3.5 layer kinds (full attention, gated-delta-net) and of the MLP: what the FSDP2
# loop's LoRA adapts unless train.lora_target_modules narrows it
FSDP2_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
                      "out_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class TrainConfig:
    loop: Literal["fsdp2", "trl"] = "fsdp2"
    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0
    warmup_steps: int = 0
    schedule: Literal["constant", "cosine", "linear"] = "cosine"
    min_lr_ratio: float = 0.0
    # None: `epochs` passes over the data; else the steps trained, the data repeated past one pass as
    # transformers' max_steps does (each pass in a new seeded order; `epochs` then unused)
    max_steps: int | None = None
    epochs: int = 1                          # passes; each after the first reshuffled (seed data.seed + epoch)
    micro_batch_size: int = 1                # packed blocks per micro-batch
    grad_accum: int = 1
    max_grad_norm: float | None = 1.0        # 0 or None: no clipping (both loops)
    # FSDP2 loop: auto (the memory plan picks the least recompute that fits the GPU), none, full, selective,
    # every:N, or parts such as gated_delta+mlp (recipe/checkpointing.py); the TRL loop reads gradient_checkpointing
    activation_checkpointing: str = "auto"
    master_weights: Literal["fp32", "bf16"] = "fp32"
    log_every: int = 100
    checkpoint_every: int = 500
    # FSDP2 loop: write and upload each periodic checkpoint in the background (train/checkpointer.py)
    async_checkpoint: Literal["auto", "on", "off"] = "auto"   # auto: on GPU workers
    eval_every: int | None = 0               # held-out loss every N steps and at the end; 0 or None: off
    # sample generations at the start, each checkpoint and the end (FSDP2 loop; MLflow table samples.json):
    # N (the first N held-out conversations, cut before their last answer), or a .jsonl/.json file of
    # prompts or conversations; 0: off
    sample_prompts: str | int = 0
    sample_max_new_tokens: int = 64          # greedy, stopped at the end-of-turn token or here
    keep_checkpoints: int = 2
    # false: end without a final checkpoint or hf/ export (throughput runs of models too big to write
    # out); periodic checkpoints still follow checkpoint_every; nothing is registered
    save_final: bool = True
    load_best_at_end: bool = False
    compile: bool = False
    # fp8: the decoder layers' big matmuls in float8 through torchao (train/fp8.py), FSDP2 loop only, on
    # GPUs with float8 matmuls (compute capability 8.9+, checked on the worker); mxfp8 needs Blackwell
    precision: Literal["bf16", "fp8"] = "bf16"
    fp8_recipe: Literal["tensorwise", "rowwise", "mxfp8"] = "tensorwise"
    seed: int = 0
    # the start-up kernel check on each GPU worker (models/kernel_check.py): "check" switches a failing
    # fast kernel off for the run and says so; "strict" stops the run instead; "off" skips the check
    kernels: Literal["check", "strict", "off"] = "check"
    # the FSDP2 loop's data (and held-out rows) read by threads from before the model is built, so Ray Data's
    # tasks run while the model is built and compiled: "auto" on GPU workers (a node's spare cores), "on",
    # "off" (read when the first step asks, after the model)
    read_ahead: Literal["auto", "on", "off"] = "auto"
    # each node's folder for the JIT caches (Triton, tilelang, FLA autotune, Inductor; train/jit_cache.py),
    # an absolute path or ~/...; None: ~/.cache/raytune_ft/jit. Also shared through the run's storage.
    cache_dir: str | None = None
    # Python's compiled modules of every process of the job in `<cache_dir>/bytecode` (env.keep_bytecode):
    # "auto" where Python would otherwise compile torch from source at every start (PYTHONDONTWRITEBYTECODE
    # set, or a read-only site-packages, and no bytecode shipped), "on" wherever Python writes none beside
    # the sources, "off"; a PYTHONPYCACHEPREFIX you set wins
    bytecode_cache: Literal["auto", "on", "off"] = "auto"
    # LoRA (both loops): rank (0: full fine-tune), scale alpha / r, dropout, the linears to adapt (empty: all;
    # the FSDP2 loop's names are FSDP2_LORA_TARGETS); lora_lr_multiplier: the TRL loop only
    lora_r: int = 0
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    lora_target_modules: list[str] = field(default_factory=list)
    lora_lr_multiplier: float = 1.0
    # TRL loop only
    use_liger: bool = False                  # honoured only where a GPU is present
    gradient_checkpointing: bool = True
    max_length: int | None = None            # TRL: per-example truncation length
    packing: bool = True                     # TRL: feed packed blocks from the project's pipeline
    merge_adapter: bool = True

    def validate(self, data: DataConfig, registry: RegistryConfig) -> None:
        check_range("train.lr", self.lr, 0.0, 1.0, lo_open=True)
        b1, b2 = self.betas
        check_range("train.betas[0]", b1, 0.0, 1.0)
        check_range("train.betas[1]", b2, 0.0, 1.0)
        if not (b1 < 1.0 and b2 < 1.0):
            raise RecipeError(f"train.betas: {self.betas!r} out of range (allowed: each in [0, 1))")
        check_range("train.weight_decay", self.weight_decay, 0.0, 1.0)
        check_range("train.warmup_steps", self.warmup_steps, 0)
        check_range("train.min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)
        if self.max_steps is not None:
            check_range("train.max_steps", self.max_steps, 1)
            if self.warmup_steps > self.max_steps:
                raise RecipeError(f"train.warmup_steps: {self.warmup_steps} exceeds train.max_steps={self.max_steps}")
        check_range("train.epochs", self.epochs, 1, 1000)
        check_range("train.micro_batch_size", self.micro_batch_size, 1, 4096)
        check_range("train.grad_accum", self.grad_accum, 1, 4096)
        if self.max_grad_norm is not None:
            check_range("train.max_grad_norm", self.max_grad_norm, 0.0)
        check_range("train.log_every", self.log_every, 1)
        check_range("train.checkpoint_every", self.checkpoint_every, 1)
        if self.eval_every is not None:
            check_range("train.eval_every", self.eval_every, 0)
        self._validate_samples(data)
        check_range("train.keep_checkpoints", self.keep_checkpoints, 1, 1000)
        if self.cache_dir is not None and not self.cache_dir.startswith(("/", "~")):
            raise RecipeError(f"train.cache_dir: {self.cache_dir!r} is not an absolute path (or ~/...): each "
                              "node reads it on its own, from a folder of its own")
        if not self.save_final and registry.enabled:
            raise RecipeError("train.save_final: false leaves no final model to register; "
                              "set registry.enabled=false too")
        check_range("train.lora_r", self.lora_r, 0, 4096)
        check_range("train.lora_dropout", self.lora_dropout, 0.0, 1.0)
        check_range("train.lora_lr_multiplier", self.lora_lr_multiplier, 0.0, 1e4, lo_open=True)
        if self.lora_r and self.loop == "fsdp2":
            self._validate_fsdp2_lora()
        if self.precision == "fp8" and self.loop != "fsdp2":
            raise RecipeError("train.precision: fp8 is offered by the FSDP2 loop only (train.loop='fsdp2')")
        if self.load_best_at_end and not self.eval_every:
            raise RecipeError("train.load_best_at_end: needs train.eval_every and a validation set")
        if self.eval_every and not data.validation_fraction and data.validation_split is None:
            raise RecipeError("train.eval_every: no validation data (set data.validation_fraction or "
                              "data.validation_split)")
        if self.max_length is not None:
            check_range("train.max_length", self.max_length, 16, 1 << 20)

    def _validate_fsdp2_lora(self) -> None:
        check_range("train.lora_alpha", self.lora_alpha, 0, lo_open=True)
        unknown = [m for m in self.lora_target_modules if m not in FSDP2_LORA_TARGETS]
        if unknown:
            raise RecipeError(f"train.lora_target_modules: {unknown} (allowed: {', '.join(FSDP2_LORA_TARGETS)})")
        if self.lora_lr_multiplier != 1.0:
            raise RecipeError("train.lora_lr_multiplier: the TRL loop's; the FSDP2 loop trains only the adapters, "
                              "so set train.lr itself")

    def reads_held_out(self) -> bool:
        """Evaluation, or sample prompts cut from held-out conversations, read the held-out rows; nothing else."""
        return bool(self.eval_every or self.sample_count())

    def sample_count(self) -> int | None:
        """N when `sample_prompts` asks for N held-out conversations (0: no samples), None for a file."""
        text = str(self.sample_prompts).strip()
        return int(text or 0) if isinstance(self.sample_prompts, int) or text.isdigit() or not text else None

    def _validate_samples(self, data: DataConfig) -> None:
        n = self.sample_count()
        text = str(self.sample_prompts).strip()
        if n is not None:
            check_range("train.sample_prompts", n, 0, 1000)
            if n and not data.validation_fraction and data.validation_split is None:
                raise RecipeError(f"train.sample_prompts: {n} held-out conversations need held-out data (set "
                                  "data.validation_fraction or data.validation_split, or give a prompt file)")
        else:
            n = 1
            if not text.endswith((".jsonl", ".json")) or not os.path.isfile(os.path.expanduser(text)):
                raise RecipeError(f"train.sample_prompts: {text!r} is not a .jsonl/.json file of prompts "
                                  "(or a number of held-out conversations)")
        if n and self.loop != "fsdp2":
            raise RecipeError("train.sample_prompts: sample generations are offered by the FSDP2 loop only "
                              "(train.loop='fsdp2')")
        check_range("train.sample_max_new_tokens", self.sample_max_new_tokens, 1, 1 << 16)


@dataclass
class ScalingConfig:
    num_workers: int = 8
    use_gpu: bool = True
    gpus_per_node: int = 8
    cpus_per_worker: float = 1.0
    resources_per_worker: dict[str, float] = field(default_factory=dict)
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    accelerator_type: str | None = None
    max_failures: int = 3
    # ranks that split each packed block along the sequence (models/context_parallel, train/context_parallel)
    context_parallel: int = 1

    def validate(self) -> None:
        check_range("scaling.num_workers", self.num_workers, 1, 100_000)
        check_range("scaling.context_parallel", self.context_parallel, 1, 1024)
        if self.num_workers % self.context_parallel:
            raise RecipeError(f"scaling.context_parallel: {self.context_parallel} does not divide "
                              f"scaling.num_workers={self.num_workers} into whole context-parallel groups")
        check_range("scaling.gpus_per_node", self.gpus_per_node, 1, 64)
        check_range("scaling.cpus_per_worker", self.cpus_per_worker, 0.0, 1024, lo_open=True)
        check_range("scaling.max_failures", self.max_failures, -1, 10_000)
        if self.use_gpu and self.num_workers > self.gpus_per_node and self.num_workers % self.gpus_per_node:
            raise RecipeError(
                f"scaling.num_workers: {self.num_workers} workers do not fill whole nodes of "
                f"scaling.gpus_per_node={self.gpus_per_node} GPUs (allowed: up to {self.gpus_per_node}, "
                f"or a multiple of it)")
        if self.backend == "nccl" and not self.use_gpu:
            raise RecipeError("scaling.backend: 'nccl' needs scaling.use_gpu=true (use 'gloo' or 'auto' on CPU)")
        for k, v in self.resources_per_worker.items():
            if not isinstance(v, (int, float)) or v < 0:
                raise RecipeError(f"scaling.resources_per_worker.{k}: {v!r} must be a number >= 0")
        # CPU/GPU here would silently override cpus_per_worker / the loops' one-GPU-per-worker layout
        if "CPU" in self.resources_per_worker:
            raise RecipeError("scaling.resources_per_worker.CPU: set scaling.cpus_per_worker instead")
        if "GPU" in self.resources_per_worker:
            raise RecipeError("scaling.resources_per_worker.GPU: each worker drives one GPU; "
                              "set scaling.use_gpu=true and scaling.num_workers instead")
        if self.accelerator_type is not None and not self.use_gpu:
            raise RecipeError(f"scaling.accelerator_type: {self.accelerator_type!r} needs scaling.use_gpu=true")


@dataclass
class TrackingConfig:
    storage_path: str = "~/raytune_runs"     # Ray Train storage; shared by every node on a cluster
    run_name: str = "qwen27b-ultrachat"      # re-submitting the same name resumes it
    tracking_uri: str | None = None          # None: sqlite file under the run's folder
    experiment: str = "raytune_ft"
    # each node's GPU utilisation, memory and power (and CPU, memory, disk, network) as MLflow system metrics
    # (train/system_metrics.py): "auto" on GPU runs, "on", "off"
    system_metrics: Literal["auto", "on", "off"] = "auto"

    def validate(self) -> None:
        if not self.experiment.strip():
            raise RecipeError("tracking.experiment: must not be empty")
        if not self.storage_path.strip():
            raise RecipeError("tracking.storage_path: must not be empty")
        if not _RUN_NAME.match(self.run_name):
            raise RecipeError(f"tracking.run_name: {self.run_name!r} (allowed: letters, digits, '.', '_', '-')")
        if self.tracking_uri is not None and not re.match(r"^(sqlite:///|file:|https?://|databricks)",
                                                          self.tracking_uri):
            raise RecipeError(f"tracking.tracking_uri: {self.tracking_uri!r} (allowed: sqlite:///path, "
                              "file:path, http(s)://host, databricks)")


@dataclass
class RegistryConfig:
    name: str = "main.default.qwen27b_ultrachat"   # catalog.schema.model
    registry_uri: str | None = None          # None: the tracking store; "databricks-uc"; "uc:http://host:port"
    enabled: bool = True
    timeout_s: float = 1800.0
    num_cpus: float = 1.0
    memory_gb: float | None = None

    def validate(self) -> None:
        validate_registry_name(self.name)
        if self.registry_uri is not None and not (
                self.registry_uri == "databricks-uc" or self.registry_uri.startswith(
                    ("uc:http://", "uc:https://", "databricks-uc://", "sqlite:///", "http://", "https://",
                     "file:"))):
            raise RecipeError(f"registry.registry_uri: {self.registry_uri!r} (allowed: databricks-uc, "
                              "uc:http://host:port, an MLflow tracking URI, or unset for the run's own store)")
        check_range("registry.timeout_s", self.timeout_s, 0.0, lo_open=True)
        check_range("registry.num_cpus", self.num_cpus, 0.0, 1024, lo_open=True)
