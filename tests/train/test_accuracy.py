"""The acceptance tables (train/accuracy.py): how often head k+1's rank-r guess is the backbone's own greedy
token, and how often its r-th drawn candidate is the one rejection sampling accepts. The product rule on each
predicts its rule's tokens per step; the tables survive a save and load; a bad file is one clear error."""

import itertools
import json
import math

import pytest
import torch

from conftest import VICUNA, OracleHeads, random_heads, tiny_model
from medusa_mini.decoding import generate, medusa_generate
from medusa_mini.heads import HeadsConfig
from medusa_mini.sampling import Sampling, sampling_probs
from medusa_mini.train import accuracy
from medusa_mini.tree import build_tree


def _prompts(n, length=5):
    return [torch.randint(0, 64, (length,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(n)]


def test_continuations_are_plain_greedy_decoding_at_temperature_zero(model):
    prompts = _prompts(20) + [[3, 1, 4]]  # more than one batch of rows, prompts of two lengths
    assert accuracy.continuations(model, prompts, max_new_tokens=12) == [
        p + generate(model, p, max_new_tokens=12)[0] for p in prompts]


def test_a_guess_is_a_token_of_the_draft_vocabulary():
    """Oracle heads over a draft vocabulary: always right where the true token is in it, never elsewhere."""
    seqs = accuracy.continuations(model := tiny_model(3), _prompts(4), max_new_tokens=30)
    written = sorted({t for s in seqs for t in s[5:]})
    for draft in (written, written[::2]):  # every token the heads must guess, then half of them
        heads = OracleHeads(model, seqs, draft_ids=torch.tensor(draft))
        acc = accuracy.measure_head_accuracy(model, heads, seqs, prompt_lens=[5] * 4, top_k=1)
        inside = [sum(s[t] in draft for s in seqs for t in range(6 + k, len(s))) / sum(len(s) - 6 - k for s in seqs)
                  for k in range(4)]
        assert acc[:, 0].tolist() == pytest.approx(inside) and (draft != written or inside == [1.0] * 4)


@pytest.mark.parametrize("kind", ["medusa", "hydra"])
def test_sampled_acceptance_is_the_mean_sum_min_p_q_and_the_drawn_tables_first_try_passes_as_often(kind):
    """Written plainly: head k at t (from each prompt's last token) against the backbone's p at t+k, both at
    the temperature, over a draft vocabulary of half the tokens (q is 0 outside it); hydra heads read the
    sampled tokens between t and their guess. The drawn table's first rank estimates it from seeded draws. A
    prompt alone, or with one new token, gives head 1 no target: it counts nothing."""
    heads, T = random_heads(model := tiny_model(5), num_heads=3, seed=5, kind=kind, draft=32), 1.5
    seqs = accuracy.continuations(model, _prompts(4, length=6), max_new_tokens=20, temperature=T, seed=2)
    assert seqs != accuracy.continuations(model, _prompts(4, length=6), max_new_tokens=20)  # sampled, not greedy
    seqs += [seqs[0][:6], seqs[1][:7]]
    sums = [[] for _ in range(3)]
    for s in seqs:
        logits, hidden = model(torch.tensor([s]))
        p = sampling_probs(logits[0], temperature=T)  # [T, V]
        for t in range(5, len(s) - 1):
            q, following = torch.zeros(3, 64), torch.tensor(s[t + 1 : t + 4] + [0] * 3)[:3]
            q[:, heads.draft_ids] = torch.softmax(heads(hidden[0, t], model, following=following) / T, dim=-1)
            for k in range(1, min(4, len(s) - 1 - t)):  # the heads whose target is in s
                sums[k - 1].append(torch.minimum(p[t + k], q[k - 1]).sum().item())
    exact = accuracy.measure_sampled_acceptance(model, heads, seqs, prompt_lens=6, temperature=T)
    assert exact.tolist() == pytest.approx([sum(v) / len(v) for v in sums], abs=1e-6)
    assert 0.1 < exact.min() and exact.max() < 0.95  # neither all nor nothing: a real test of the sum
    drawn, again = (accuracy.measure_try_acceptance(model, heads, seqs, prompt_lens=6, temperature=T, ranks=5,
                                                    repeats=32, seed=1) for _ in range(2))
    assert drawn.shape == (3, 5) and drawn[:, 0].tolist() == pytest.approx(exact.tolist(), abs=0.02)
    assert (drawn[:, 1:] > 0.01).all() and drawn.equal(again)  # later draws pass too, less often; seeded


class Fixed:
    """A backbone whose p and a head whose q are the same at every position: logits [1, T, V] and [1, m, V]."""

    device, draft_ids, num_heads = torch.device("cpu"), torch.arange(4), 1

    def __init__(self, p, q):
        self.config = HeadsConfig(vocab_size=len(p))  # only its vocab_size is read
        self.log_p, self.log_q = torch.tensor(p).log(), torch.tensor(q).log()

    def __call__(self, x, *args, following=None):  # the model on tokens [1, T]; the heads on hidden [m, C]
        if args:
            return self.log_q.expand(1, len(x), -1)
        return self.log_p.expand(1, x.shape[1], -1), torch.zeros(1, x.shape[1], 1)


def test_the_drawn_table_is_the_chance_that_each_draw_is_the_one_accepted_and_q_equal_to_p_always_is():
    """Written out for one p and q over four tokens: draws x0, x1, x2, x_k from q_k (q without the earlier draws,
    renormalised), tried against r_k (p, then norm(max(0, r_k - q_k)) after a miss), pass with min(1, r_k/q_k)."""
    p, q, want = [0.4, 0.3, 0.2, 0.1], [0.1, 0.1, 0.3, 0.5], [0.0, 0.0, 0.0]
    for draws in itertools.permutations(range(4), 3):
        qs = [[0.0 if y in draws[:k] else b / (1 - sum(q[d] for d in draws[:k])) for y, b in enumerate(q)]
              for k in range(3)]  # [q_0, q_1, q_2]
        chance, r = math.prod(q_k[x] for q_k, x in zip(qs, draws)), p  # the draws in this order, no try passed yet
        for k, (q_k, x) in enumerate(zip(qs, draws)):  # r is not read after x_2, whose miss may leave nothing
            a, rest = min(1.0, r[x] / q_k[x]), [max(0.0, s - t) for s, t in zip(r, q_k)]
            want[k], chance, r = want[k] + chance * a, chance * (1 - a), [s / (sum(rest) or 1.0) for s in rest]
    fixed, seqs = Fixed(p, q), [list(range(12))]
    got = accuracy.measure_try_acceptance(fixed, fixed, seqs, prompt_lens=1, temperature=1.0, ranks=3, repeats=400)
    assert got[0].tolist() == pytest.approx(want, abs=0.015)
    fixed = Fixed(p, p)  # heads whose q is p: always accepted, and only their first draw is tried
    exact = accuracy.measure_sampled_acceptance(fixed, fixed, seqs, prompt_lens=1, temperature=0.9)
    drawn = accuracy.measure_try_acceptance(fixed, fixed, seqs, prompt_lens=1, temperature=0.9, ranks=3)
    assert exact.tolist() == pytest.approx([1.0]) and drawn[0].tolist() == pytest.approx([1.0, 0.0, 0.0], abs=1e-5)


def test_the_drawn_table_predicts_rejection_samplings_tokens_per_step():
    """The product rule on the drawn table (`build_tree`, as `decode.py --tree N` builds rejection sampling's
    tree) against the tokens per step that rejection sampling of drawn candidates makes on that tree."""
    heads, T, prompts = random_heads(model := tiny_model(3), num_heads=3, seed=3), 2.0, _prompts(16)
    seqs = accuracy.continuations(model, prompts, max_new_tokens=48, temperature=T, seed=1)
    drawn = accuracy.measure_try_acceptance(model, heads, seqs, prompt_lens=5, temperature=T, ranks=4)
    tree, expected = build_tree(drawn, 6)
    assert {(1,), (0, 0)} <= set(tree.choices)  # a second try at the root is worth more than depth 3
    stats = [medusa_generate(model, heads, p, tree=tree, max_new_tokens=48, sampling=Sampling(temperature=T),
                             generator=torch.Generator().manual_seed(i))[1] for i, p in enumerate(prompts)]
    rate = sum(sum(st.step_tokens) for st in stats) / sum(st.steps for st in stats)
    assert 1.5 < expected and 0.9 < (rate - 1) / (expected - 1) < 1.1


class Lagged:
    """A model whose logits at t are table[x[t - lag]]: with lag 0 a bigram model, where p of token t+2
    depends on token t+1 (the root); with lag 1 it does not."""

    device = torch.device("cpu")

    def __init__(self, lag, vocab_size=12):
        self.table, self.lag = torch.randn(vocab_size, vocab_size, generator=torch.Generator().manual_seed(7)) * 2, lag
        self.config = HeadsConfig(vocab_size=vocab_size)  # only its vocab_size is read

    def __call__(self, x):
        return self.table[x if self.lag == 0 else torch.cat([x[:, :1], x[:, :-1]], dim=1)], None


def test_a_head_that_cannot_see_the_root_is_capped_by_its_marginal_over_the_root():
    seqs, T = [[1, 2, 3, 4, 5, 6, 7], [3, 3, 0, 9, 11, 2]], 0.7
    blind = Lagged(lag=1)  # p of token t+2 ignores token t+1: the marginal is p itself, always accepted
    got, covered = accuracy.measure_marginal_acceptance(blind, seqs, prompt_lens=2, temperature=T, roots=3, every=1)
    assert got == pytest.approx(1) and covered < 0.99  # the likeliest 3 roots' shares, renormalised, sum to 1
    bigram = Lagged(lag=0)
    p, want, top3 = torch.softmax(bigram.table / T, dim=-1), [], []  # p [V, V]: p(next token | token)
    for s in seqs:
        for t in range(1, len(s) - 2):
            p_root = p[s[t]]  # [V] the root's distribution
            want.append((p_root * torch.minimum(p, p_root @ p).sum(-1)).sum().item())  # marginal Σ_r p(r) p(· | r)
            top3.append(p_root.topk(3).values.sum().item())  # the mass of the likeliest 3 roots
    got, covered = accuracy.measure_marginal_acceptance(bigram, seqs, prompt_lens=2, temperature=T, roots=12, every=1)
    assert got == pytest.approx(sum(want) / len(want)) and covered == pytest.approx(1.0) and got < 0.9
    _, covered = accuracy.measure_marginal_acceptance(bigram, seqs, prompt_lens=2, temperature=T, roots=3, every=1)
    assert covered == pytest.approx(sum(top3) / len(top3))


def test_measured_accuracy_counts_each_rank_and_predicts_measured_tokens_per_step():
    model, prompts = tiny_model(2), _prompts(6)
    seqs = accuracy.continuations(model, prompts, max_new_tokens=44)  # 40 decoded + room for 4 heads
    heads = OracleHeads(model, seqs, true_rank_probs=(0.55, 0.2, 0.1), seed=2)
    acc = accuracy.measure_head_accuracy(model, heads, seqs, prompt_lens=5, top_k=10)
    # 6 sequences x ~40 positions per head: the measured rates sit near the chances of each rank, 0 past them
    assert acc.shape == (4, 10) and acc.dtype == torch.float64 and acc[:, 3:].sum() == 0
    assert torch.allclose(acc[:, :3], torch.tensor([[0.55, 0.2, 0.1]], dtype=torch.float64), atol=0.12)
    tree, expected = build_tree(acc, 8)
    _, stats = zip(*(medusa_generate(model, heads, p, tree=tree, max_new_tokens=40) for p in prompts))
    rate = sum(sum(st.step_tokens) for st in stats) / sum(st.steps for st in stats)
    assert 1.5 < expected and 0.8 < rate / expected < 1.2


def test_accuracy_survives_a_save_and_load_round_trip_and_prints_cumulative_top1_and_top5(tmp_path):
    accuracy.save_accuracy(tmp_path, VICUNA, meta={"measured_on": "hand-written", "num_prompts": 0})
    assert torch.allclose(accuracy.load_accuracy(tmp_path), VICUNA.double(), atol=1e-6)
    saved = json.loads((tmp_path / "heads_accuracy.json").read_text())
    assert saved["top_k"] == 10 and saved["num_heads"] == 4 and saved["measured_on"] == "hand-written"
    lines = accuracy.format_accuracy(VICUNA).splitlines()
    assert "head  top-1  top-5 " in lines[0] and "top-1  top-2 " in accuracy.format_accuracy(VICUNA[:, :2])
    assert lines[1:] == ["   1  0.560  0.999", "   2  0.320  0.571", "   3  0.200  0.357", "   4  0.150  0.268"]


@pytest.mark.parametrize("content", ["not json", "[1, 2]", '{"acc": []}', '{"acc": [[0.5], [0.5, 0.2]]}',
                                     '{"acc": [[0.5, "x"]]}', '{"acc": [[1.5]]}', '{"rows": [[0.5]]}', None])
def test_a_bad_or_missing_accuracy_file_gives_a_clear_error(tmp_path, content):
    (folder := tmp_path / "my ckpt").mkdir()  # the command it suggests quotes the folder
    if content is not None:
        (folder / "heads_accuracy.json").write_text(content)
    with pytest.raises(ValueError, match="heads_accuracy.json" if content else f"cli.measure --ckpt '{folder}'$"):
        accuracy.load_accuracy(folder)
