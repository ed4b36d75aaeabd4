"""FSDP2's own path on the CPU: `fully_shard` per decoder layer and the root, gloo, a few AdamW steps.

    torchrun --standalone --nproc_per_node=2 tests/dist_fsdp2_check.py MODEL_DIR OUT.json   # sharded
    python tests/dist_fsdp2_check.py MODEL_DIR OUT.json                                     # one process

The same global batch each step (the two ranks take one half each), full fine-tuning
in fp32. Writes {world_size, backend, wrapper, sharded_parameters, parameters_held,
parameters, losses[], final_params_file (the gathered weights)} so
`tests/test_distributed.py` compares the sharded run with the single process.
HF Trainer's FSDP on the CPU silently becomes DDP, so this drives `fully_shard` directly.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

STEPS = 6
GLOBAL_BATCH = 4
SEQ_LEN = 64
LR = 1e-3


def batches(vocab: int) -> list[torch.Tensor]:
    """Two random batches, alternating: different data each step, and a loss that visibly falls."""
    g = torch.Generator().manual_seed(0)
    two = [torch.randint(0, vocab, (GLOBAL_BATCH, SEQ_LEN), generator=g) for _ in range(2)]
    return [two[i % 2] for i in range(STEPS)]


def main(model_dir: str, out: str) -> None:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    world = dist.get_world_size() if distributed else 1
    rank = dist.get_rank() if distributed else 0

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.config.use_cache = False
    if distributed:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        assert isinstance(model, FSDPModule)
    params = list(model.parameters())
    held = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in params)
    total = sum(p.numel() for p in params)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)

    losses = []
    share = GLOBAL_BATCH // world
    for ids in batches(model.config.vocab_size):
        mine = ids[rank * share : (rank + 1) * share]
        # Equal token counts on every rank: the mean of the ranks' mean losses is the global mean,
        # and FSDP averages gradients over ranks.
        loss = model(input_ids=mine, labels=mine).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = loss.detach().clone()
        if distributed:
            dist.all_reduce(value)
            value /= world
        losses.append(float(value))

    full = {}
    for name, p in model.state_dict().items():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p  # DTensor shards gathered on every rank
        full[name] = t.detach().clone()
    if rank == 0:
        torch.save(full, out + ".pt")
        result = {
            "world_size": world,
            "backend": dist.get_backend() if distributed else None,
            "wrapper": type(model).__name__,
            "sharded_parameters": sum(type(p).__name__ == "DTensor" for p in params),
            "parameters_held": held,
            "parameters": total,
            "losses": losses,
            "final_params_file": out + ".pt",
        }
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
