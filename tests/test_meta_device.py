"""The GPU path on a CPU: every stage of the engine on torch's `meta` device, under CUDA's device rules.

A meta tensor has a shape, a dtype and a device but no data, so the engine runs on it as on a GPU whose
values nobody may read. A tensor made without `device=` (torch.tensor, torch.arange, torch.zeros) then
meets a model tensor and the op raises, which is the commonest way code that passes on a CPU fails on a
GPU. Meta alone is laxer than CUDA in two places, which `CudaRules` closes: it lets a CPU index tensor
into gather and scatter, and a CPU generator draw numbers for a meta tensor.

Every read of a device value on the host (tolist, item, int, .cpu()) is where a GPU waits. `CudaRules`
either stops there (`HostRead`, so a test can say where the first read is: the one that ends a step) or
answers it with made-up values, so that whole decoding loops run to their end on the device.

A generator cannot live on meta (torch.Generator(device="meta") is refused: meta is no accelerator),
and meta's own kernels take a CPU generator for a meta draw, which CUDA refuses. So one CPU generator,
`GEN`, stands for the device's: `CudaRules` counts it as on the meta device, refuses it for a draw on
the host (as CUDA refuses the GPU's generator there), and refuses every other generator for a meta draw.

Shapes: B rows, T tokens, N tree nodes, C n_embd, V vocabulary.
"""

import os
import traceback

import pytest
import torch
from conftest import random_heads, tiny_model
from device_rules import CudaRules, HostRead
from torch.utils._pytree import tree_leaves

from medusa_mini import acceptance, model as model_module, reference
from medusa_mini.decoding import generate_batch, make_proposer, medusa_generate_batch, prefill
from medusa_mini.heads import HeadsConfig
from medusa_mini.hydra import make_heads, teacher_forced_logits
from medusa_mini.model import KVCache
from medusa_mini.sampling import Sampling
from medusa_mini.step import medusa_step
from medusa_mini.training import MedusaLM, sample_continuations
from medusa_mini.tree import preset

META = torch.device("meta")
V, C = 64, 32
TREE = preset("cpu")
SAMPLINGS = {
    "greedy": Sampling(),
    "typical": Sampling(acceptance="typical", temperature=0.8),
    "rejection": Sampling(temperature=0.8),  # candidates drawn from the heads' q
    "rejection-topk": Sampling(temperature=0.8, draft="topk"),  # decided on the device, as greedy is
}
PROPOSERS = ["medusa", "hydra"]
GEN = torch.Generator().manual_seed(0)  # stands for the meta device's generator (see the module docstring)


def meta_rules(*, answer_reads: bool = False) -> CudaRules:
    """CUDA's rules on the meta device, GEN counted as its generator."""
    return CudaRules(META, device_generator=GEN, answer_reads=answer_reads)


def first_host_read(run) -> str | None:
    """Run `run()` on the meta device under CUDA's rules: the engine function (module.function) that first
    read a value on the host, or None if none did. A device mismatch raises as it is."""
    try:
        with meta_rules():
            run()
    except HostRead as read:
        frames = [f for f in traceback.extract_tb(read.__traceback__) if f"{os.sep}medusa_mini{os.sep}" in f.filename]
        return f"{os.path.splitext(os.path.basename(frames[-1].filename))[0]}.{frames[-1].name}"
    return None


def meta_model(dtype: torch.dtype = torch.float32):
    return tiny_model(0).to(META, dtype)


def meta_heads(kind: str, dtype: torch.dtype = torch.float32):
    if kind == "medusa":
        return random_heads(tiny_model(0)).to(META, dtype)
    return make_heads(HeadsConfig(num_heads=4, n_embd=C, vocab_size=V, kind="hydra")).eval().to(META, dtype)


def meta_proposer(model, kind: str):
    return make_proposer(model, meta_heads(kind), TREE)


def prefilled(model, *, dtype: torch.dtype = torch.float32):
    """A 2-row cache after prompts of 3 and 5 tokens, and each row's prefill logits [B, V] and hidden [B, C]."""
    cache = KVCache(model.config, batch_size=2, max_len=model.config.block_size + 16, device=META, dtype=dtype)
    logits, hidden = prefill(model, torch.zeros(2, 5, dtype=torch.long, device=META), cache, lengths=[3, 5])
    return cache, logits, hidden


def all_on_meta(*tensors) -> bool:
    return all(t.device == META for t in tree_leaves(tensors) if isinstance(t, torch.Tensor))


# ---- the stages, on the device alone ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_a_prefill_of_rows_of_different_lengths_and_a_plain_step_stay_on_the_device(dtype):
    model = meta_model(dtype)
    with meta_rules():
        cache, logits, hidden = prefilled(model, dtype=dtype)
        k_before = [t for t in cache.k]
        with torch.no_grad():  # as decoding runs it
            step_logits, step_hidden = model(logits.argmax(-1)[:, None], cache=cache)  # the plain step, T = 1
    assert (logits.shape, hidden.shape, step_logits.shape) == ((2, V), (2, C), (2, 1, V))
    assert all_on_meta(logits, hidden, step_logits, step_hidden, cache.k, cache.v, cache._lengths)
    assert all(a is b for a, b in zip(cache.k, k_before))  # written in place


def test_medusa_and_hydra_heads_stay_on_the_device_in_decoding_and_in_training():
    model, medusa, hydra = meta_model(), meta_heads("medusa"), meta_heads("hydra")
    own = random_heads(tiny_model(0), own_lm_head=True).to(META)
    hidden, y = torch.zeros(2, 7, C, device=META), torch.zeros(2, 7, dtype=torch.long, device=META)
    with meta_rules():
        with torch.no_grad():  # decoding: the K blocks as one batched matmul
            decoding = [medusa(hidden[:, -1], model.lm_head), own(hidden[:, -1], model.lm_head),
                        hydra.head_logits(2, hidden[:, -1], y[:, :2], lm_head=model.lm_head, wte=model.transformer.wte)]
        training = [medusa(hidden, model.lm_head), teacher_forced_logits(hydra, hidden, y, model)]
    assert [tuple(t.shape) for t in decoding + training] == [(4, 2, V), (4, 2, V), (2, V), (4, 2, 7, V), (4, 2, 7, V)]
    assert all_on_meta(decoding, training)


@pytest.mark.parametrize("rule", SAMPLINGS)
@pytest.mark.parametrize("kind", PROPOSERS)
def test_a_step_reads_the_host_only_at_its_end_or_for_the_rejection_walk(kind, rule):
    """Every stage of the step under CUDA's rules (a device mismatch raises): the proposer fills its tree,
    verify, the usable nodes (row 0 near its end), the rule and keep_path, all before the one read."""
    model = meta_model()
    proposer = meta_proposer(model, kind)

    def step(stop_at):
        cache, logits, hidden = prefilled(model)
        medusa_step(model, cache, proposer, logits.argmax(-1), hidden, sampling=SAMPLINGS[rule], generator=GEN,
                    stop_at=stop_at, max_depth=4)

    want = "acceptance.rejection_accept_drawn" if rule == "rejection" else "step.medusa_step"
    assert first_host_read(lambda: step(torch.tensor([6, 64], device=META))) == want  # row 0: depth 1 at most
    assert first_host_read(lambda: step(None)) == want  # the default: the context


def test_decoding_reads_the_host_first_for_the_prefills_token():
    model, heads = meta_model(), meta_heads("medusa")
    prompts, sampled = [[1, 2, 3], [4, 5, 6, 7, 8]], Sampling(temperature=0.8)
    assert first_host_read(lambda: generate_batch(model, prompts, max_new_tokens=4, sampling=sampled,
                                                  generator=GEN)) == "decoding.generate_batch"
    assert first_host_read(lambda: medusa_generate_batch(model, heads, prompts, tree=TREE, max_new_tokens=4,
                                                         sampling=sampled, generator=GEN)) == "decoding.medusa_generate_batch"
    # The reference decodes with the engine's model on any device too.
    assert first_host_read(lambda: reference.medusa_generate(model, heads, prompts[0], tree=TREE, max_new_tokens=4,
                                                             sampling=sampled, generator=GEN)) == "reference.next_token"


@pytest.mark.parametrize("rule", SAMPLINGS)
@pytest.mark.parametrize("kind", PROPOSERS)
def test_whole_generations_run_on_the_device_when_each_host_read_is_answered(kind, rule):
    """Past the first read too: every step, the rejection walk's device draws, a row that stops at the
    context while the other goes on. Greedy, typical and top-k rejection decoding read the host once after
    the prefill and once per step."""
    with meta_rules(answer_reads=True) as rules:
        results = medusa_generate_batch(meta_model(), meta_heads(kind), [[1] * 60, [4, 5, 6]], tree=TREE,
                                        max_new_tokens=6,
                                        sampling=SAMPLINGS[rule], generator=GEN)
    # Made-up reads accept no candidate (a count of 0): each step emits its bonus alone; row 0 meets the
    # context (64 tokens) first.
    assert [(len(tokens), stats.steps, stats.stop_reason) for tokens, stats in results] == [
        (4, 3, "context"), (6, 5, "max_new_tokens")]
    if rule != "rejection":
        assert rules.reads == 1 + 5


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=0.8)], ids=["greedy", "sampled"])
def test_plain_generation_runs_on_the_device_reading_the_host_once_per_token(sampling):
    with meta_rules(answer_reads=True) as rules:
        results = generate_batch(meta_model(), [[1] * 61, [4, 5]], max_new_tokens=5, sampling=sampling,
                                 generator=GEN)
    assert [len(tokens) for tokens, _ in results] == [3, 5]
    assert rules.reads == 5  # the prefill's token, then one per step


@pytest.mark.parametrize("kind", ["medusa", "hydra"])
@pytest.mark.parametrize("stage", ["joint", "heads"])
def test_a_training_step_runs_forward_and_backward_on_the_device(kind, stage):
    """MedusaLM's forward, the chunked heads loss (checkpointed chunks) and the backward; no host read."""
    model, heads = tiny_model(0).to(META).train(), meta_heads(kind).train()
    x = torch.zeros(2, 17, dtype=torch.long, device=META)
    valid = torch.ones(2, 16, dtype=torch.bool, device=META)
    kw = (dict(lm_weight=1.0, heads_weight=0.2, decay=0.8, heads_stride=3, heads_offset=2, heads_chunk=5)
          if stage == "joint" else dict(lm_weight=0.0, heads_weight=1.0, decay=1.0, detach_backbone=True, heads_chunk=7))
    with meta_rules():
        loss, metrics = MedusaLM(model, heads)(x[:, :-1], x[:, 1:], valid=valid, **kw)
        loss.backward()
    assert all_on_meta(loss, metrics, [p.grad for p in heads.parameters()])
    assert all(p.grad is not None for p in heads.parameters())
    assert (model.transformer.h[0].mlp.c_fc.weight.grad is not None) == (stage == "joint")  # Medusa-1: detached


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_self_distillation_writes_its_continuations_on_the_device(temperature):
    model = meta_model()
    with meta_rules():
        out = sample_continuations(model, torch.zeros(3, 4, dtype=torch.long, device=META), max_new_tokens=5,
                                   temperature=temperature, generator=GEN)
    assert out.shape == (3, 9) and out.device == META


# ---- the checks can fail ---------------------------------------------------------------------------


def test_meta_alone_lets_a_host_index_and_a_host_generator_through_and_cuda_rules_refuse_them():
    x = torch.zeros(2, 4, device=META)
    host_index, host_generator = torch.zeros(2, 1, dtype=torch.long), torch.Generator().manual_seed(0)
    x.gather(1, host_index)  # meta's own kernels accept both; CUDA does not
    torch.rand(3, device=META, generator=host_generator)
    with meta_rules(), pytest.raises(RuntimeError, match="one device"):
        x.gather(1, host_index)
    with meta_rules(), pytest.raises(RuntimeError, match="generator on device cpu draws for device meta"):
        torch.rand(3, device=META, generator=host_generator)
    with meta_rules(), pytest.raises(RuntimeError, match="generator on device meta draws for device cpu"):
        torch.rand(3, generator=GEN)  # the device's generator drawing on the host
    with pytest.raises(RuntimeError, match="not an accelerator"):
        torch.Generator(device=META)
    with meta_rules():  # what CUDA takes: a host index, a host scalar, the device's generator on the device
        x[torch.tensor([1, 0])] + torch.tensor(2.0)
        torch.rand(3, device=META, generator=GEN)


def causal_mask_on_the_host(T, *, device="cpu"):
    return torch.ones(T, T, dtype=torch.bool).tril()  # device= forgotten


WHOLE_PATH_PASSES = acceptance.whole_path_passes


def whole_path_passes_with_a_host_index(tree, passes):
    B, N = passes.shape
    return WHOLE_PATH_PASSES(tree, passes.gather(1, torch.arange(N).expand(B, N)))  # device= forgotten


@pytest.mark.parametrize("module, name, misplaced", [
    (model_module, "causal_mask", causal_mask_on_the_host),
    (acceptance, "whole_path_passes", whole_path_passes_with_a_host_index),
], ids=["a mask on the host (meta's own check)", "a gather index on the host (CudaRules)"])
def test_a_tensor_left_on_the_host_in_the_engine_fails_the_device_run(monkeypatch, module, name, misplaced):
    model = meta_model()
    proposer = meta_proposer(model, "medusa")
    monkeypatch.setattr(module, name, misplaced)

    def step():
        cache, logits, hidden = prefilled(model)
        medusa_step(model, cache, proposer, logits.argmax(-1), hidden)

    with pytest.raises(RuntimeError, match="device"):  # a mismatch, not a HostRead (first_host_read catches those)
        first_host_read(step)
