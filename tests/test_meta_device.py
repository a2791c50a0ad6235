"""The GPU path on a CPU: every stage of the engine on torch's `meta` device, under CUDA's device rules.

A meta tensor has a shape, a dtype and a device but no data: the engine runs on it as on a GPU whose
values nobody may read, and a tensor made without `device=` fails where it meets a model tensor, the
commonest way code that passes on a CPU fails on a GPU. `CudaRules` closes meta's gaps (a CPU index in
gather, a CPU generator drawing for a meta tensor) and answers each host read with made-up values,
counting it. The CPU generator `GEN` stands for the device's, which cannot live on meta."""

import pytest
import torch
from torch.utils._pytree import tree_leaves

from conftest import RULES, random_heads, tiny_model
from device_rules import CudaRules
from medusa_mini import KVCache, PromptLookup, Sampling, acceptance, preset, reference
from medusa_mini import model as model_module
from medusa_mini.cli.compiled import compile_steps
from medusa_mini.decoding import generate_batch, medusa_generate_batch, prefill
from medusa_mini.step import medusa_step
from medusa_mini.training import MedusaLM, self_distill

META, TREE, DRAFTERS = torch.device("meta"), preset("cpu"), ["medusa", "hydra", "lookup"]
GEN = torch.Generator().manual_seed(0)  # stands for the meta device's generator (see the module docstring)


def meta_rules(*, answer_reads: bool = False) -> CudaRules:
    return CudaRules(META, device_generator=GEN, answer_reads=answer_reads)


def meta_drafter(kind: str):
    return PromptLookup() if kind == "lookup" else random_heads(tiny_model(0), kind=kind, draft=16).to(META)


# ---- the stages, on the device alone ---------------------------------------------------------------


def test_the_reference_decodes_with_the_engines_model_on_the_device():
    with meta_rules(answer_reads=True):
        out, _ = reference.medusa_generate(tiny_model().to(META), meta_drafter("medusa"), [1, 2, 3], tree=TREE,
                                           max_new_tokens=4, sampling=Sampling(temperature=0.8), generator=GEN)
    assert len(out) == 4


@pytest.mark.parametrize("steps", ["eager", "compiled"])
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("kind", DRAFTERS)
def test_whole_generations_run_on_the_device_when_each_host_read_is_answered(kind, rule, steps):
    """Every stage of every step under CUDA's rules (a device mismatch raises), row 0 meeting the context
    while row 1 goes on; also with cli/compiled.py's steps, run eagerly (compiling: the identity). Decoding
    reads the host once after the prefill and once per step."""
    compiled = dict(steps=compile_steps(META, compile=lambda fn: fn)) if steps == "compiled" else {}
    with meta_rules(answer_reads=True) as rules:
        results = medusa_generate_batch(tiny_model().to(META), meta_drafter(kind), [[1] * 60, [4, 5, 6]], tree=TREE,
                                        max_new_tokens=6, sampling=RULES[rule], generator=GEN, **compiled)
    # Made-up reads accept no candidate (a count of 0): each step emits its bonus alone; row 0 meets the context first.
    assert [(len(tokens), stats.steps, stats.stop_reason) for tokens, stats in results] == [
        (4, 3, "context"), (6, 5, "max_new_tokens")]
    assert rules.reads == 1 + 5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=0.8)], ids=["greedy", "sampled"])
def test_plain_generation_and_self_distillation_run_on_the_device_reading_the_host_once_per_token(sampling, dtype):
    """The prefill of rows of different lengths (one meets the context), then the plain step, in either format."""
    with meta_rules(answer_reads=True) as rules:
        results = generate_batch(tiny_model().to(META, dtype), [[1] * 61, [4, 5]], max_new_tokens=5, sampling=sampling,
                                 generator=GEN)
    assert [len(tokens) for tokens, _ in results] == [3, 5] and rules.reads == 5
    with meta_rules(answer_reads=True) as rules:
        out = self_distill(tiny_model().to(META, dtype), torch.zeros(3, 4, dtype=torch.long, device=META),
                           max_new_tokens=5, temperature=sampling.temperature, generator=GEN)
    assert out.shape == (3, 9) and out.device == META and rules.reads == 1 + 5  # the prompts, then each token


@pytest.mark.parametrize("kind", ["medusa", "hydra"])
@pytest.mark.parametrize("stage", ["joint", "heads"])
def test_a_training_step_runs_forward_and_backward_on_the_device(kind, stage):
    """MedusaLM's forward, draft-vocabulary targets, the heads loss in checkpointed chunks, backward; no host read."""
    model, heads = tiny_model().to(META).train(), meta_drafter(kind).train()
    x, valid = torch.zeros(2, 17, dtype=torch.long, device=META), torch.ones(2, 16, dtype=torch.bool, device=META)
    kw = (dict(lm_weight=1.0, heads_weight=0.2, decay=0.8, heads_stride=3, heads_offset=2, heads_chunk=5)
        if stage == "joint" else dict(lm_weight=0.0, heads_weight=1.0, decay=1.0, detach_backbone=True, heads_chunk=7))
    with meta_rules():
        loss, metrics = MedusaLM(model, heads)(x[:, :-1], x[:, 1:], valid=valid, **kw)
        loss.backward()
    on_device = tree_leaves((loss, metrics, [p.grad for p in heads.parameters()]))
    assert all(t.device == META for t in on_device if isinstance(t, torch.Tensor))
    assert all(p.grad is not None for p in heads.parameters())


# ---- the checks can fail ---------------------------------------------------------------------------


def test_meta_alone_lets_a_host_index_and_a_host_generator_through_and_cuda_rules_refuse_them():
    x = torch.zeros(2, 4, device=META)
    host_index, host_generator = torch.zeros(2, 1, dtype=torch.long), torch.Generator().manual_seed(0)
    gather, host_draw = lambda: x.gather(1, host_index), lambda: torch.rand(3, device=META, generator=host_generator)
    assert gather().device == host_draw().device == META  # meta's own kernels accept both; CUDA does not
    for refused, message in [(gather, "one device"), (host_draw, "generator on device cpu draws for device meta"),
                             (lambda: torch.rand(3, generator=GEN),  # the device's generator on the host
                              "generator on device meta draws for device cpu")]:
        with meta_rules(), pytest.raises(RuntimeError, match=message):
            refused()
    pytest.raises(RuntimeError, torch.Generator, device=META).match("not an accelerator")
    with meta_rules():  # what CUDA takes: a host index, a host scalar, the device's generator on the device
        x[torch.tensor([1, 0])] + torch.tensor(2.0)
        torch.rand(3, device=META, generator=GEN)


@pytest.mark.parametrize("module, name, misplaced", [  # each with its device= forgotten
    (model_module, "causal_table", lambda T, dtype, device: torch.full((T, T + 2), -torch.inf, dtype=dtype).triu(2)),
    (acceptance, "path_scores", lambda tree, passes, real=acceptance.path_scores: real(
        tree, passes.gather(1, torch.arange(passes.shape[1]).expand(passes.shape)))),
], ids=["a mask on the host (meta's own check)", "a gather index on the host (CudaRules)"])
def test_a_tensor_left_on_the_host_in_the_engine_fails_the_device_run(monkeypatch, module, name, misplaced):
    proposer = meta_drafter("medusa").proposer(model := tiny_model().to(META), TREE)
    monkeypatch.setattr(module, name, misplaced)
    cache = KVCache(model.config, batch_size=2, max_len=model.config.block_size + 16, device=META)
    with meta_rules(answer_reads=True), pytest.raises(RuntimeError, match="device"):
        logits, hidden = prefill(model, torch.zeros(2, 5, dtype=torch.long, device=META), cache, lengths=[3, 5])
        medusa_step(model, cache, proposer, logits.argmax(-1), hidden, history=[[1, 2, 3], [1, 2, 3, 4, 5]],
                    stop_at=torch.full((2,), 64, device=META))
