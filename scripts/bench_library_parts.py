"""Where finetune keeps its own code beside a library's: the measurements behind each choice.

    python scripts/bench_library_parts.py                 # about a minute on 2 CPU cores
    python scripts/bench_library_parts.py --convs 20000   # the cache row at a larger data set

Each section prints a table; BENCHMARKS.md ("Hand-written parts against the libraries") records one run.

1. Packed batches: do packed samples stay apart (each sample's logits equal to the sample run alone), and
   what attention mask does SDPA receive? Ours, TRL's DataCollatorForLanguageModeling (padded with position
   ids, and padding_free) and transformers' DataCollatorWithFlattening, on the tiny model.
2. Token counts with pad = eos (what a Llama 3.x tokenizer gets, models.load_tokenizer): the Trainer's
   include_num_input_tokens_seen="non_padding" counts ids != pad; ours counts the rows' real lengths.
3. The prepared-data cache: the data stage cold, then again with the same config (our cache hit).
4. DeepSpeed's values when deepspeed.json says "auto": what zero.Init (which reads the file while the model
   loads, before the Trainer fills "auto") uses, against what transformers would fill in later.
5. Checkpoints: a newest checkpoint truncated by a full disk; which one does each side resume from?
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def collators() -> None:
    import torch
    from transformers import DataCollatorWithFlattening
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from finetune.core.composition import compose
    from finetune.modeling import tiny
    from finetune.modeling.collator import NUM_TOKENS_KEY, PackedCollator

    model = tiny.load_model(compose([]).model).eval()
    g = torch.Generator().manual_seed(0)
    samples = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (40, 30, 58, 60, 25, 35, 64)]
    split = [[0, 1, 2], [3, 4, 5], [6]]  # three packed rows
    rows = [sum((samples[i] for i in part), []) for part in split]
    lengths = [[len(samples[i]) for i in part] for part in split]
    masks: list = []
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def spy(module, q, k, v, attention_mask, **kw):
        masks.append(None if attention_mask is None else tuple(attention_mask.shape))
        return sdpa(module, q, k, v, attention_mask, **kw)

    ALL_ATTENTION_FUNCTIONS["sdpa"] = spy
    try:
        with torch.no_grad():
            alone = [model(input_ids=torch.tensor([s])).logits[0] for s in samples]

        def isolated(batch: dict, flat: bool) -> tuple[str, object]:
            masks.clear()
            keys = {k: v for k, v in batch.items() if k not in ("labels", NUM_TOKENS_KEY, "seq_idx")}
            with torch.no_grad():
                out = model(**keys, use_cache=False).logits
            # the second sample of the first two rows
            a, b = (out[0, 40:70], out[0, 128 + 60 : 128 + 85]) if flat else (out[0, 40:70], out[1, 60:85])
            ok = torch.allclose(a, alone[1], atol=1e-4) and torch.allclose(b, alone[4], atol=1e-4)
            return ("yes" if ok else "NO"), masks[0] if masks else None

        ours = [
            {"input_ids": r, "labels": r, "position_ids": sum((list(range(n)) for n in ls), [])}
            for r, ls in zip(rows, lengths)
        ]
        trl_rows = [{"input_ids": r, "seq_lengths": ls} for r, ls in zip(rows, lengths)]
        cases = [
            ("finetune PackedCollator", PackedCollator(pad_token_id=0)(ours), False),
            (
                "TRL DataCollatorForLanguageModeling (padded, position ids)",
                DataCollatorForLanguageModeling(pad_token_id=0, return_position_ids=True)(trl_rows),
                False,
            ),
            (
                "TRL DataCollatorForLanguageModeling (padding_free)",
                DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(trl_rows),
                True,
            ),
            (
                "transformers DataCollatorWithFlattening",
                DataCollatorWithFlattening()([{"input_ids": s, "labels": s} for s in samples]),
                True,
            ),
        ]
        print("\n## 1. Packed batches (tiny model, SDPA, 3 packed rows of 7 samples)\n")
        print("| collator | batch shape | samples stay apart | mask SDPA receives |")
        print("|---|---|---|---|")
        for name, batch, flat in cases:
            ok, mask = isolated(batch, flat)
            print(f"| {name} | {tuple(batch['input_ids'].shape)} | {ok} | {mask} |")
        micro, seq = 4, 8192
        print(
            f"\nAt a micro-batch of {micro} rows x {seq:,} tokens, SDPA's boolean mask (and its masked attention "
            f"work) is {micro * seq * seq / 1e9:.2f} GB for rows kept apart and {(micro * seq) ** 2 / 1e9:.2f} GB "
            f"({micro}x) for the micro-batch flattened into one row."
        )
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa


def token_counts(work: Path) -> None:
    from finetune.core.composition import compose
    from finetune.data import stage as data_stage
    from finetune.modeling import tiny

    cfg = compose(["train.seq_len=512", f"data.cache_dir={work / 'cache-tokens'}"])
    tok = tiny.load_tokenizer(cfg.model)
    data_stage.run(cfg, work / "tokens", tokenizer=tok)
    train, _ = data_stage.load_prepared(work / "tokens")
    eos = tok.eos_token_id
    real = sum(len(r) for r in train["input_ids"])
    non_pad = sum(sum(1 for t in r if t != eos) for r in train["input_ids"])
    print("\n## 2. Tokens counted with pad = eos (bundled data, seq_len 512, before padding)\n")
    print("| counter | tokens | against the real count |")
    print("|---|---|---|")
    print(f"| finetune (the rows' lengths) | {real:,} | 0.0% |")
    print(
        f'| include_num_input_tokens_seen="non_padding" (ids != pad) | {non_pad:,} | '
        f"{100 * (non_pad - real) / real:+.1f}% |"
    )


def cache(work: Path, convs: int) -> None:
    from finetune.core.composition import compose
    from finetune.data import stage as data_stage
    from finetune.modeling import tiny

    lines = (REPO / "finetune" / "data" / "bundled" / "chat.jsonl").read_text().splitlines()
    path = work / "chats.jsonl"
    with path.open("w") as out:
        for i in range(convs):
            record = json.loads(lines[i % len(lines)])
            record["messages"][0]["content"] += f" (#{i})"  # distinct, so deduplication keeps every one
            out.write(json.dumps(record) + "\n")
    overrides = ["data=jsonl", f"data.path={path}", "train.seq_len=512", f"data.cache_dir={work / 'cache'}"]
    cfg = compose(overrides)
    tok = tiny.load_tokenizer(cfg.model)
    seconds = []
    for run in ("cold", "hit"):
        t0 = time.perf_counter()
        data_stage.run(cfg, work / f"data-{run}", tokenizer=tok)
        seconds.append(time.perf_counter() - t0)
    print(f"\n## 3. The data stage, {convs:,} conversations (JSONL), same config twice\n")
    print("| run | seconds |")
    print("|---|---|")
    print(f"| cold (read, clean, dedup, split, tokenize, pack) | {seconds[0]:.1f} |")
    print(f"| again: finetune's cache hit | {seconds[1]:.1f} |")


def deepspeed_auto() -> None:
    import deepspeed.runtime.zero.config as zero_config

    h = 8192  # Llama 70B
    auto = zero_config.DeepSpeedZeroConfig(
        stage=3,
        reduce_bucket_size="auto",
        stage3_prefetch_bucket_size="auto",
        stage3_param_persistence_threshold="auto",
    )
    print('\n## 4. ZeRO-3 sizes when deepspeed.json says "auto" (hidden size 8192)\n')
    print("| setting | zero.Init at load reads | transformers fills in at Trainer init | finetune writes |")
    print("|---|---|---|---|")
    rows = [
        ("reduce_bucket_size", auto.reduce_bucket_size, h * h),
        ("stage3_prefetch_bucket_size", auto.prefetch_bucket_size, int(0.9 * h * h)),
        ("stage3_param_persistence_threshold", auto.param_persistence_threshold, 10 * h),
    ]
    for name, init, hf in rows:
        print(f"| {name} | {init:,} | {hf:,} | {hf:,} |")


def checkpoint_choice(work: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers.trainer_utils import get_last_checkpoint

    from finetune.rundir import checkpoints

    folder = work / "checkpoints"
    for step in (1, 2):
        ckpt = folder / f"checkpoint-{step}"
        ckpt.mkdir(parents=True)
        save_file({"lora_A": torch.randn(1000)}, str(ckpt / "adapter_model.safetensors"))
        (ckpt / checkpoints.TRAINER_STATE_FILE).write_text(json.dumps({"global_step": step}))
        checkpoints.write_manifest(ckpt, step)
    newest = folder / "checkpoint-2" / "adapter_model.safetensors"
    newest.write_bytes(newest.read_bytes()[:1000])  # the disk filled up mid-write
    theirs = Path(get_last_checkpoint(str(folder))).name
    ours = checkpoints.last_complete(folder)
    print("\n## 5. Resuming when the newest checkpoint was truncated\n")
    print("| side | resumes from |")
    print("|---|---|")
    print(f"| transformers get_last_checkpoint | {theirs} (truncated) |")
    print(
        f"| finetune checkpoints.last_complete (manifest sizes + SHA-256) | {ours.name if ours else None} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--convs", type=int, default=5000, help="conversations for the cache row")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        os.environ.setdefault("FINETUNE_CACHE", str(work / "finetune-cache"))
        collators()
        token_counts(work)
        cache(work, args.convs)
        deepspeed_auto()
        checkpoint_choice(work)


if __name__ == "__main__":
    main()
