"""medusa_mini: Medusa decoding (arXiv 2401.10774) in a few small, readable files.

The Medusa core sits at the top of the package and imports only torch, numpy and itself:
model, heads, tree, sampling, draft, acceptance, step, decoding, training. The wings import the
core, never the reverse: io/ (tokenizer, safetensors, checkpoints, GPT-2 weights), train/ (the
train_tiny.py run), tune/ (acceptance tables, tree sizing, clocks), cli/ (shared command-line code).
"""

from .acceptance import (
    greedy_accept,
    greedy_accept_paths,
    rejection_accept,
    typical_accept,
    typical_accept_paths,
)
from .decoding import GenerationStats, generate, medusa_generate
from .heads import HeadsConfig, MedusaHeads
from .model import GPT, GPTConfig, KVCache, compact_kv_cache
from .sampling import Sampling, sampling_probs
from .tree import Tree, build_tree, chain, preset

__all__ = [
    "GPT", "GPTConfig", "KVCache", "compact_kv_cache", "HeadsConfig", "MedusaHeads", "Tree", "build_tree",
    "chain", "preset", "Sampling", "sampling_probs", "greedy_accept", "rejection_accept", "typical_accept",
    "greedy_accept_paths", "typical_accept_paths",
    "GenerationStats", "generate", "medusa_generate",
]
