"""The CPU plan of a DPO run against what TRL's DPOTrainer really holds (scripts/bench_planner.py --only dpo).

TRL's fused head allocates its tile buffer 32,768 values wide whatever the vocabulary; a narrower
vocabulary writes only the first `vocab` values of each row, so on the CPU, where the run's peak is the
process's resident set, only those pages count. CUDA's allocator counts the whole buffer.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from helpers import planned

from finetune.planner.job import CPU_PAGE_BYTES, TRL_TILE_VOCAB, make_job, runtime
from finetune.planner.step import trl_tile_buffer


def _job_and_runtime(*overrides: str):
    cfg, plan = planned(*overrides)
    from finetune.core.objectives import OBJECTIVES

    job = make_job(cfg.model, cfg.method, cfg.hardware, cfg.train, plan.seq_len, objective=OBJECTIVES["dpo"])
    return job, plan, runtime(job, plan.strategy)


def test_cpu_tile_buffer_counts_the_pages_a_small_vocabulary_writes():
    job, plan, rt = _job_and_runtime("+recipe=tiny_dpo")
    assert rt.resident and rt.compute == 4 and job.model.vocab_size == 512
    # 32 pairs of 64 tokens: 4,096 rows of the tile; each row's 512 fp32 logits (2 KB) touch one 4 KB page
    assert trl_tile_buffer(job, rt, 4096) == 4096 * CPU_PAGE_BYTES == 16_777_216
    # the allocator's view (CUDA, or a count of allocated bytes): the whole [4096, 32768] buffer
    assert trl_tile_buffer(job, replace(rt, resident=False), 4096) == 4 * 4096 * TRL_TILE_VOCAB
    # the plan's loss term carries the resident figure (0.602 GB with the whole buffer): the buffer's 17 MB, TRL's CPU tile
    # folding (7.25 fp32 copies of [4096, 512]) and the accumulators
    assert plan.gpu_memory.logits == pytest.approx(0.082, abs=0.001)


def test_a_vocabulary_as_wide_as_the_tile_is_resident_whole():
    job, _, rt = _job_and_runtime("+recipe=tiny_dpo", "model=smollm2_135m")
    assert job.model.vocab_size >= TRL_TILE_VOCAB
    assert trl_tile_buffer(job, rt, 1000) == rt.compute * 1000 * TRL_TILE_VOCAB
