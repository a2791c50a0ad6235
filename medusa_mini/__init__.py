"""medusa_mini: Medusa decoding (arXiv 2401.10774) in a few small, readable files.

Read `reference.py` first: the whole algorithm in one file that runs, batch 1. The engine makes the
same decisions fast, for batches: sampling, tree, model (GPT-2 and a static KV cache), heads (Medusa's
and dependent ones), proposal (the candidates of one step, prompt lookup's too), acceptance, step, decoding;
then training. All of it imports only torch, the standard library and itself. The wings import the core, never
the reverse: io/ (tokenizer, safetensors, checkpoints, GPT-2 weights), train/ (the train_tiny.py
run), cli/ (the command lines' shared code and the compiled steps).
"""

from . import reference
from .acceptance import Accepted, accept
from .decoding import GenerationStats, generate, generate_batch, medusa_generate, medusa_generate_batch
from .heads import HeadsConfig, HydraHeads, MedusaHeads, make_heads
from .model import GPT, GPTConfig, KVCache, compact_kv_cache
from .proposal import PromptLookup
from .sampling import Sampling, sampling_probs
from .tree import Tree, build_tree, chain, preset

__all__ = ["reference", "GPT", "GPTConfig", "KVCache", "compact_kv_cache", "HeadsConfig", "MedusaHeads", "HydraHeads",
           "make_heads", "PromptLookup", "Tree", "build_tree", "chain", "preset", "Sampling", "sampling_probs",
           "Accepted", "accept", "GenerationStats", "generate", "generate_batch", "medusa_generate",
           "medusa_generate_batch"]
