"""Peak memory of loading a checkpoint: transformers in one process vs `rewrite.from_pretrained` per rank.

    .venv/bin/python -m bench.checkpoint_memory            # ~160M-parameter model, ~1 minute on 2 cores
    .venv/bin/python -m bench.checkpoint_memory --layers 4  # smaller

Writes a random LLaMA checkpoint (fp32, transformers' own save_pretrained), then in
fresh processes measures, per rank: parameter bytes held, how far the load (and touching
every parameter once, as a first step would) raised the peak resident set (VmHWM, which
includes file pages mapped while reading) and the process's own memory (RssAnon).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

import rewrite
from tests.multiproc import run

PLANS = {  # name: (plan, ranks)
    "transformers": (None, 1),
    "rewrite pp1 x tp1": ({"mesh": {"pp": 1, "tp": 1}}, 1),
    "rewrite tp2": ("plans/llama-tp2.yaml", 2),
    "rewrite pp2": ("plans/llama-pp2.yaml", 2),
    "rewrite tp2 x pp2": ("plans/llama-tp2-pp2.yaml", 4),
}


def _status_mib() -> dict[str, float]:
    """Resident set now (VmRSS, of which RssAnon is the process's own memory) and its peak (VmHWM)."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {k: int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "RssAnon", "VmHWM")}  # kB


def _load(rank: int, ws: int, directory: str, plan) -> dict:
    from transformers import AutoModelForCausalLM

    before = _status_mib()
    if plan is None:
        module = AutoModelForCausalLM.from_pretrained(directory)
    else:
        module = rewrite.from_pretrained(directory, plan).model
    with torch.no_grad():  # touch every parameter, as the first step will (mapped pages become resident)
        for p in module.parameters():
            p.sum()
    after = _status_mib()
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    return {"params_mib": params / 2**20, "peak_rise": after["VmHWM"] - before["VmRSS"],
            "anon_rise": after["RssAnon"] - before["RssAnon"], "rss_rise": after["VmRSS"] - before["VmRSS"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4, num_hidden_layers=args.layers,
        num_attention_heads=16, num_key_value_heads=8, vocab_size=args.vocab, tie_word_embeddings=False,
    )
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-") as tmp:
        model = AutoModelForCausalLM.from_config(config)
        total = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        model.save_pretrained(tmp, max_shard_size="200MB")
        del model
        files = sum(p.stat().st_size for p in Path(tmp).glob("*.safetensors")) / 2**20
        print(f"checkpoint: {total:.0f} MiB of fp32 parameters in {files:.0f} MiB of safetensors files\n")
        print("| load | ranks | params / rank (MiB) | largest share | peak RSS rise / rank (MiB) "
              "| own memory (RssAnon) rise / rank (MiB) |")
        print("|---|---|---|---|---|---|")
        for name, (plan, ranks) in PLANS.items():
            results = run(_load, ranks, tmp, plan, timeout_s=600)
            cells = [" / ".join(f"{r[key]:.0f}" for r in results) for key in ("params_mib", "peak_rise", "anon_rise")]
            share = max(r["params_mib"] for r in results) / total
            print(f"| {name} | {ranks} | {cells[0]} | {share:.0%} | {cells[1]} | {cells[2]} |")

if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
