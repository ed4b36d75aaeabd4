"""One rank of a sequence split on the CPU: DeepSpeed's Ulysses over gloo, or the whole sequence on one rank.

Started by torchrun (tests/test_sequence_parallel.py, scripts/bench_sequence_parallel.py), never imported:

    torchrun --standalone --nproc_per_node 2 scripts/sequence_parallel_worker.py --out OUT.json --dtype bf16

Every rank builds the same small Llama (full fine-tuning, every parameter in `--dtype`, no autocast: as
ZeRO-3's bf16 runs it) and the same token sequence. With two ranks or more, DeepSpeed's
`UlyssesSPAttentionHF.register_with_transformers` wraps SDPA (the all-to-all before and after attention) and
each rank takes its contiguous share of the sequence with its position ids, as accelerate's
`UlyssesSPDataLoaderAdapter` hands it out; the labels are shifted over the whole sequence first, as the
adapter does. The loss is the token-weighted mean over the ranks (transformers' `deepspeed_sp_compute_loss`),
the gradients are summed over the ranks and divided by the tokens. Rank 0 writes OUT.json: the loss, the
gradients (flattened, fp32), each rank's share of the sequence, the bytes the second decoder layer saved for
backward on each rank (counted as scripts/measure_activations.py counts them) and the median step seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure_activations import SavedBytes  # noqa: E402

# The model: 4 query heads, 2 key/value heads (Ulysses over 2 ranks divides both), 2 decoder layers.
SHAPE = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=8192,
)
IGNORE = -100


def build(dtype: torch.dtype) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE, attn_implementation="sdpa"))
    return model.to(dtype).train()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=1, help="timed forward+backward passes after the first")
    ap.add_argument("--kv-heads", type=int, default=SHAPE["num_key_value_heads"])
    args = ap.parse_args()
    SHAPE["num_key_value_heads"] = args.kv_heads
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    model = build(dtype)
    if world > 1:
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

        UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=model,
            core_attn_implementation="sdpa",
            sequence_parallel_size=world,
            micro_batch_size=1,
            seq_length_is_variable=True,
        )
    seq = args.seq_len
    ids = torch.randint(0, SHAPE["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(1))
    shift_labels = torch.cat([ids[:, 1:], torch.full((1, 1), IGNORE)], dim=1)
    positions = torch.arange(seq)[None]
    share = seq // world
    mine = slice(rank * share, (rank + 1) * share)
    layer = model.model.layers[1]
    exclude = list(layer.parameters())
    counted: dict[str, Any] = {}

    def enter(module: Any, inputs: Any) -> None:
        counted["saved"] = SavedBytes(exclude).__enter__()

    def leave(module: Any, inputs: Any, output: Any) -> None:
        counted["saved"].__exit__(None, None, None)

    handles = [layer.register_forward_pre_hook(enter), layer.register_forward_hook(leave)]

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids[:, mine], position_ids=positions[:, mine])
        target = shift_labels[:, mine]
        loss_sum = torch.nn.functional.cross_entropy(
            out.logits.float().view(-1, SHAPE["vocab_size"]),
            target.reshape(-1),
            ignore_index=IGNORE,
            reduction="sum",
        )
        loss_sum.backward()
        return loss_sum.detach(), (target != IGNORE).sum()

    loss_sum, tokens = step()
    for h in handles:
        h.remove()
    saved = counted["saved"].total
    del counted["saved"]
    grads = torch.cat([p.grad.float().flatten() for p in model.parameters()])
    totals = torch.stack([loss_sum.float(), tokens.float()])
    if world > 1:
        dist.all_reduce(totals)
        dist.all_reduce(grads)
    grads /= totals[1]
    saved_per_rank = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(saved_per_rank, torch.tensor([float(saved)], dtype=torch.float64))
    times = []
    for _ in range(args.steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        dist.barrier()
        times.append(time.perf_counter() - start)
    if rank == 0:
        Path(args.out).write_text(
            json.dumps(
                {
                    "world": world,
                    "dtype": args.dtype,
                    "seq_len": seq,
                    "rank_tokens": share,
                    "loss": (totals[0] / totals[1]).item(),
                    "grads": grads.tolist(),
                    "layer_saved_bytes": [int(t.item()) for t in saved_per_rank],
                    "step_seconds": statistics.median(times) if times else None,
                    "shape": SHAPE,
                }
            )
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
