"""Memory of one heads-stage training step (Medusa-1, paper §2.2.1): the heads' loss chunked vs in one piece.

    python benchmarks/train_memory.py                  # gpt2 shape, the gpt2 preset's heads batch
    python benchmarks/train_memory.py --device cuda --dtype float32 --json

The heads stage projects K heads x B sequences x T positions onto the vocabulary: at GPT-2's 50,257
tokens, 4 x 32 x 159 x 50,257 ≈ 1.0G logits, 4 GB in float32; `chunked_head_loss` keeps one chunk's
alive at a time. On random weights this prints the computed size of all logits and of one chunk's (in
the forward's format and in float32, as cross-entropy upcasts) and, on CUDA only (a CPU has no peak
counter in torch), max_memory_allocated over one step chunked and unchunked, also above what was
allocated before it. Bad input ends in one line on stderr and exit status 2.
"""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script from anywhere, without installing the package
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from benchmarks.clock import at_least_one  # noqa: E402
from medusa_mini.cli.common import OneLineParser, pick_device  # noqa: E402
from medusa_mini.heads import HeadsConfig, MedusaHeads  # noqa: E402
from medusa_mini.io.gpt2 import GPT2_CONFIGS  # noqa: E402
from medusa_mini.model import GPT, GPTConfig  # noqa: E402
from medusa_mini.train.backbone import GPT2_PRESETS  # noqa: E402
from medusa_mini.train.device import autocast, default_dtype  # noqa: E402
from medusa_mini.training import MedusaLM, head_chunk_size  # noqa: E402

GIB = 2**30
_PRESET = GPT2_PRESETS["gpt2"]
DEFAULT_BATCH = _PRESET["heads_batch_size"]  # 32
DEFAULT_POSITIONS = _PRESET["distill_prompt_len"] + _PRESET["distill_tokens"] - 1  # 159 inputs per sequence
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def logits_sizes(*, num_heads: int, batch: int, positions: int, vocab: int, chunk: int, dtype: str) -> dict:
    """Computed, not measured: elements and GiB of all heads' logits and of one chunk's."""
    chunk = min(chunk, batch * positions)
    full, one = num_heads * batch * positions * vocab, num_heads * chunk * vocab
    return {"logits_elements": full, "chunk_positions": chunk, "chunks": -(-batch * positions // chunk),
            "logits_gib": full * BYTES[dtype] / GIB, "logits_gib_float32": full * 4 / GIB,
            "chunk_gib": one * BYTES[dtype] / GIB, "chunk_gib_float32": one * 4 / GIB}


def heads_step(model: GPT, heads: MedusaHeads, *, batch: int, positions: int, chunk: int | None, dtype: str,
               seed: int = 0) -> dict:
    """One heads-stage step (forward + backward) as train_tiny.py runs it; on CUDA its peak memory."""
    device = model.device
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(model.config.vocab_size, (batch, positions + 1), generator=g).to(device)  # [B, T + 1]
    module = MedusaLM(model, heads)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    with autocast(str(device), dtype):
        loss, _ = module(seq[:, :-1], seq[:, 1:], lm_weight=0.0, heads_weight=1.0, decay=1.0,
                         detach_backbone=True, heads_chunk=chunk)
    loss.backward()
    heads.zero_grad(set_to_none=True)
    out = {"loss": loss.item()}
    if cuda:
        peak = torch.cuda.max_memory_allocated(device)
        out.update(peak_gib=peak / GIB, above_start_gib=(peak - before) / GIB)
    return out


def build(config: GPTConfig, *, num_heads: int, device: torch.device, seed: int = 0) -> tuple[GPT, MedusaHeads]:
    """Random weights on `device`; the backbone frozen, as in the heads stage."""
    torch.manual_seed(seed)
    model = GPT(config).to(device)
    for p in model.parameters():
        p.requires_grad_(False)
    heads = MedusaHeads(HeadsConfig(num_heads=num_heads, n_embd=config.n_embd, vocab_size=config.vocab_size),
                        lm_head_weight=model.lm_head.weight).to(device)
    return model, heads


def report(result: dict) -> str:
    c, lines = result["computed"], [f"heads-stage step, {result['shape']} shape, {result['heads']} heads, "
                                    f"batch {result['batch']} x {result['positions']} positions, "
                                    f"{result['dtype']}, {result['device']}"]
    half = result["dtype"] != "float32"  # the cross-entropy upcasts: say what float32 costs too
    lines.append(f"computed  all logits K x B x T x V = {c['logits_elements']:,}: {c['logits_gib']:.2f} GiB "
                 f"in {result['dtype']}" + (f", {c['logits_gib_float32']:.2f} GiB in float32" if half else ""))
    lines.append(f"computed  one chunk of {c['chunk_positions']} positions ({c['chunks']} chunks): "
                 f"{c['chunk_gib']:.3f} GiB in {result['dtype']}"
                 + (f", {c['chunk_gib_float32']:.3f} GiB in float32" if half else ""))
    if result["measured"] is None:
        lines.append("measured  nothing: torch counts peak memory on CUDA only (run with --device cuda)")
    for name, m in (result["measured"] or {}).items():
        lines.append(f"measured  {name:9s} peak {m['peak_gib']:.2f} GiB (max_memory_allocated), "
                     f"{m['above_start_gib']:.2f} GiB above the weights and batch")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="train_memory.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    p.add_argument("--shape", default="gpt2", choices=sorted(GPT2_CONFIGS), help="backbone shape (default: gpt2)")
    p.add_argument("--heads", type=int, default=4, help="Medusa heads K (default: 4)")
    p.add_argument("--batch", type=int, default=DEFAULT_BATCH,
                   help=f"sequences (default: {DEFAULT_BATCH}, the gpt2 preset's)")
    p.add_argument("--positions", type=int, default=DEFAULT_POSITIONS,
                   help=f"positions per sequence (default: {DEFAULT_POSITIONS}, the gpt2 preset's)")
    p.add_argument("--chunk", type=int, help="positions per chunk (default: train_tiny.py's)")
    p.add_argument("--dtype", choices=sorted(BYTES), help="forward's number format (default: train_tiny.py's)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    a = p.parse_args(argv)
    config = GPT2_CONFIGS[a.shape]
    try:
        device = pick_device(a.device)
        at_least_one(a, "heads", "batch", "positions", "chunk")
        if a.positions > config.block_size:
            raise ValueError(f"--positions {a.positions} is longer than {a.shape}'s context of {config.block_size}")
    except ValueError as e:
        p.error(str(e))
    dtype = a.dtype or default_dtype(str(device))
    chunk = a.chunk or head_chunk_size(a.heads, config.vocab_size)
    result = {"shape": a.shape, "heads": a.heads, "batch": a.batch, "positions": a.positions, "dtype": dtype,
              "device": str(device), "measured": None,
              "computed": logits_sizes(num_heads=a.heads, batch=a.batch, positions=a.positions,
                                       vocab=config.vocab_size, chunk=chunk, dtype=dtype)}
    if device.type == "cuda":
        model, heads = build(config, num_heads=a.heads, device=device)
        kw = dict(batch=a.batch, positions=a.positions, dtype=dtype)
        result["measured"] = {"chunked": heads_step(model, heads, chunk=chunk, **kw)}
        try:  # the unchunked step is what runs out of memory on smaller cards: report that, too
            result["measured"]["unchunked"] = heads_step(model, heads, chunk=a.batch * a.positions, **kw)
        except torch.cuda.OutOfMemoryError:
            result["measured"]["unchunked"] = {"peak_gib": float("nan"), "above_start_gib": float("nan"),
                                               "out_of_memory": True}
    print(json.dumps(result, indent=1) if a.json else report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
