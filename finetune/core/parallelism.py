"""How the work is divided across ranks: the engines and the mesh (pure: stdlib only).

One description per engine, the way finetune/core/methods.py describes methods: the planner (which
strategies each runs, what each keeps on a GPU), the launcher (the files and settings it writes), the
trainer and the record of what ran read these fields; nothing compares engine names. The key of
`ENGINES` is the plan's word (`strategy.sharding` in plan.json, `train.sharding` on the command line);
`runs_as` is the program that runs it, as plan.json's `layout.engine`, engine.json and metrics.json
name it.

A `Mesh` says how many ranks each way of dividing the work takes (torchtune's ParallelDims,
accelerate's ParallelismConfig): world = replicate x shard x sequence x expert. Sharding divides the
training state over shard x sequence ranks (FSDP2 and ZeRO-3 shard over the sequence ranks too);
sequence parallelism divides each sequence's activations; replicas and shards each take their own
batches. Expert parallelism is not built yet: its degree is 1.

A sequence split (`SEQUENCE_SPLITS`, the plan's `strategy.sequence_split`) divides each sequence over
`strategy.sequence_parallel` ranks: DeepSpeed's Ulysses (an all-to-all trades the sequence split for a head
split around attention) or torch's ring context parallelism (keys and values passed round a ring). Each is
one description here; the planner, the launcher and the record of the run read its fields.
"""

from __future__ import annotations

from dataclasses import dataclass

EIGHT_BIT = ("adamw_8bit", "paged_adamw_8bit")


@dataclass(frozen=True)
class Engine:
    """One engine's facts. `ENGINES[strategy.sharding]` is the entry of a plan."""

    key: str  # the plan's word: none | ddp | fsdp | zero3
    runs_as: str  # single | ddp | fsdp | deepspeed: the program, as plan.json's layout and engine.json say
    label: str  # for people: what the launcher prints
    short: str  # for people, in the plan's reasons
    # Needs two ranks or more.
    several_ranks: bool
    # Divides weights, gradients and optimizer state across the ranks (a method's `can_shard` applies).
    shards: bool
    # DeepSpeed's runtime runs it: its JSON config, its bf16 (every parameter cast, no autocast), zero.Init.
    deepspeed: bool
    # accelerate's FSDP2 plugin runs it (accelerate_fsdp.yaml, TrainingArguments' fsdp_config).
    fsdp2: bool
    # accelerate's `distributed_type` for it (MULTI is MULTI_GPU or MULTI_CPU by device).
    accelerate_type: str
    # Optimizers it runs without offload.
    optimizers: tuple[str, ...]
    # (offload_optimizer, offload_params) pairs it runs.
    offloads: tuple[tuple[bool, bool], ...]
    # What each offload refusal means, one line naming the keys.
    note: str
    # DDP's gradient buckets hold a second copy of the gradients.
    gradient_buckets: bool = False
    # accelerate upcasts every trainable parameter to fp32 (FSDP2), gathered in the compute dtype.
    fp32_trainable: bool = False
    # The tail unit (final norm and LM head) stays gathered from the end of the forward to the backward.
    holds_tail_gathered: bool = False
    # The LM head is gathered whole for the loss.
    gathers_head_for_loss: bool = False
    # Why an optimizer it does not run is refused (one clause), if there is more to say than its name.
    optimizer_note: str = ""
    # How the ranks load the model: every rank whole (every), the node's first rank broadcasting (first),
    # or each rank its partition (partitioned, zero.Init).
    loading: str = "every"
    # Generation inside the trainer gathers every parameter at once (TRL's `unwrap_model_for_generation` under
    # ZeRO-3 with `ds3_gather_for_generation`); FSDP2 gathers a layer at a time there, as in training.
    gathers_whole_to_generate: bool = False

    @property
    def offloads_optimizer_alone(self) -> bool:
        """It offloads the optimizer while the parameters stay on the GPU (ZeRO-Offload)."""
        return (True, False) in self.offloads


ENGINES: dict[str, Engine] = {
    "none": Engine(
        "none", "single", "one process", "one process", several_ranks=False, shards=False, deepspeed=False,
        fsdp2=False,
        accelerate_type="NO", optimizers=("adamw", *EIGHT_BIT), offloads=((False, False),),
        note="one process holds everything on its GPU: it offloads nothing",
    ),
    "ddp": Engine(
        "ddp", "ddp", "DDP (replicated)", "DDP", several_ranks=True, shards=False, deepspeed=False, fsdp2=False,
        accelerate_type="MULTI", optimizers=("adamw", *EIGHT_BIT), offloads=((False, False),),
        note="data parallel replicates the whole state on every GPU: it offloads nothing",
        gradient_buckets=True,
    ),
    # bitsandbytes' optimizers have no DTensor support (measured: "Operator bitsandbytes.optimizer_update_32bit
    # .default does not have a sharding strategy registered"); CPUOffloadPolicy moves parameters, gradients and
    # optimizer state to the host together.
    "fsdp": Engine(
        "fsdp", "fsdp", "FSDP2 full shard", "FSDP2", several_ranks=True, shards=True, deepspeed=False, fsdp2=True,
        accelerate_type="FSDP", optimizers=("adamw",), offloads=((False, False), (True, True)),
        note="FSDP2 offloads parameters, gradients and optimizer state together (CPUOffloadPolicy)",
        fp32_trainable=True, holds_tail_gathered=True, loading="first",
        optimizer_note="bitsandbytes' 8-bit optimizers have no DTensor support",
    ),
    # ZeRO-3 wraps a bitsandbytes 8-bit optimizer without offload (measured: base optimizer bnb AdamW, optim_bits
    # 8); with optimizer offload it runs only its own fp32 CPU Adam, which the plan calls adamw.
    "zero3": Engine(
        "zero3", "deepspeed", "DeepSpeed ZeRO-3", "ZeRO-3", several_ranks=True, shards=True, deepspeed=True,
        fsdp2=False,
        accelerate_type="DEEPSPEED", optimizers=("adamw", "adamw_8bit"),
        offloads=((False, False), (True, False), (True, True)),
        note="ZeRO-3 offloads the optimizer (its fp32 CPU Adam), and parameters only with it",
        gathers_head_for_loss=True, loading="partitioned", gathers_whole_to_generate=True,
    ),
}  # fmt: skip

# The engines that run a sharded plan: what `train.engine` chooses from.
SHARDED_ENGINES = tuple(key for key, e in ENGINES.items() if e.shards)
# One process, and data parallel replicas: the engines of a plan that needs no sharding.
SINGLE = next(key for key, e in ENGINES.items() if not e.several_ranks)
REPLICATED = next(key for key, e in ENGINES.items() if e.several_ranks and not e.shards)


@dataclass(frozen=True)
class Mesh:
    """How many ranks each way of dividing the work takes (see the module docstring)."""

    replicate: int = 1  # replicas of the whole training state (DDP)
    shard: int = 1  # ranks one replica's state is divided over (FSDP2, ZeRO-3)
    sequence: int = 1  # ranks each sequence is split over (a sequence split's degree)
    expert: int = 1  # ranks the experts are split over (not built yet)

    @property
    def world(self) -> int:
        return self.replicate * self.shard * self.sequence * self.expert

    @property
    def state_shards(self) -> int:
        """Ranks the weights, gradients and optimizer state are divided over."""
        return self.shard * self.sequence

    @property
    def data_parallel(self) -> int:
        """Ranks that each take their own batches."""
        return self.replicate * self.shard

    @classmethod
    def of(cls, engine: Engine, world: int, sequence: int = 1) -> Mesh:
        """The mesh an engine makes of `world` ranks, each sequence split over `sequence` of them."""
        rest = max(1, world // sequence)
        return cls(shard=rest, sequence=sequence) if engine.shards else cls(replicate=rest, sequence=sequence)


@dataclass(frozen=True)
class SequenceSplit:
    """One way of splitting a sequence across ranks. `SEQUENCE_SPLITS[strategy.sequence_split]`."""

    key: str  # the plan's word: ulysses | ring (train.sequence_split)
    label: str  # for people
    # accelerate's ParallelismConfig field that carries the degree (sp_size | cp_size), and its backend.
    size_field: str
    backend: str
    # The engine that runs it must have this property true (an `Engine` field name).
    engine_needs: str
    # The attention heads are divided over the ranks: the degree divides the query heads, and divides or is
    # divided by the key/value heads (DeepSpeed's UlyssesSPAttentionHF checks both).
    divides_heads: bool
    # The attentions (train.attention) under which rows packed from several samples keep their boundaries.
    packed_attentions: tuple[str, ...]
    # Runs on the CPU (gloo): what the tests can prove here.
    runs_on_cpu: bool
    # The training stage trains with it: its loss reads each shard's pre-shifted labels and sums over the split
    # (finetune/train/sft_trainer.py). False: planned and launched (engine.json) only, refused by the ranks.
    trains: bool
    # How it exchanges a layer's attention tensors: `all_to_all` (queries, keys, values and the output, each
    # once a pass) or `ring` (each peer's keys and values, passed round the ring).
    exchange: str
    # Query-wide tensors (heads x head_dim a token, compute dtype) each layer saves for backward beyond the
    # unsplit layer's. Measured for Ulysses (scripts/sequence_parallel_worker.py, BENCHMARKS.md): 1; the ring
    # cannot be measured here (0: what its buffers add is the working set's).
    extra_saved_queries: int
    # What it needs, as one clause naming the way out (the refusal's words).
    engine_note: str

    def exchanged_per_token(self, query_width: int, kv_width: int, degree: int) -> float:
        """Values each rank sends per local token and decoder layer in one forward pass (query_width: heads x
        head_dim; kv_width: key/value heads x head_dim)."""
        if self.exchange == "all_to_all":  # (N-1)/N of q, k, v there and of the output back
            return (2 * query_width + 2 * kv_width) * (degree - 1) / degree
        return 2 * kv_width * (degree - 1)  # its keys and values to every peer in turn


SEQUENCE_SPLITS: dict[str, SequenceSplit] = {
    # deepspeed/runtime/sequence_parallel/ulysses_sp.py (UlyssesSPAttentionHF): an all-to-all before attention
    # turns [seq/N, all heads] into [seq, heads/N], one after turns it back. Masks are dropped: causality comes
    # from position_ids, so packed rows need an attention that reads them (accelerate's docs: SDPA attends
    # across packed samples, flash attention keeps them apart). Measured here: runs over gloo on two CPU ranks
    # (tests/test_sequence_parallel.py), and trains through the pipeline (tests/test_sequence_parallel_training.py).
    "ulysses": SequenceSplit(
        "ulysses", "DeepSpeed Ulysses (ALST)", size_field="sp_size", backend="deepspeed",
        engine_needs="deepspeed", divides_heads=True, packed_attentions=("flash",), runs_on_cpu=True,
        trains=True, exchange="all_to_all", extra_saved_queries=1, engine_note="Ulysses runs under DeepSpeed (train.sharding=zero3)",
    ),
    # torch.distributed.tensor.experimental.context_parallel via accelerate's cp_size: FSDP2 only, SDPA with
    # no mask or a causal one (a packed row's block mask is refused). Measured here: does not run on the CPU
    # (aten._scaled_dot_product_flash_attention_for_cpu has no sharding strategy), so its training path (the
    # Trainer's context-parallel buffers, the chunked loss over them) is not built: planned and launched only.
    "ring": SequenceSplit(
        "ring", "torch ring context parallelism", size_field="cp_size", backend="torch",
        engine_needs="fsdp2", divides_heads=False, packed_attentions=(), runs_on_cpu=False,
        trains=False, exchange="ring", extra_saved_queries=0, engine_note="ring context parallelism runs under FSDP2 (train.sharding=fsdp)",
    ),
}  # fmt: skip
