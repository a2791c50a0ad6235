"""medusa_mini: Medusa decoding (arXiv 2401.10774) in a few small, readable files."""

from .model import GPT, GPTConfig, KVCache, compact_kv_cache
from .heads import HeadsConfig, MedusaHeads
from .tree import Tree, chain, preset
from .acceptance import greedy_accept, rejection_accept, typical_accept, sampling_probs
from .decoding import GenerationStats, generate, medusa_generate

__all__ = [
    "GPT", "GPTConfig", "KVCache", "compact_kv_cache", "HeadsConfig", "MedusaHeads", "Tree", "chain",
    "preset", "greedy_accept", "rejection_accept", "typical_accept", "sampling_probs",
    "GenerationStats", "generate", "medusa_generate",
]
