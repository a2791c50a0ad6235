"""The acceptance tables in heads_accuracy.json, measured on the model's own continuations and read back.

acc[k][r] = P(head k+1's rank-r guess is the backbone's greedy token k+2 places ahead), over every position:
`tree.build_tree` multiplies these along paths, as if the heads were right independently (as official Medusa)."""

import json
import os
import shlex
from collections.abc import Callable, Iterator, Sequence

import torch

from ..decoding import generate_batch
from ..heads import DraftHeads, next_tokens
from ..io.files import atomic_write, read_json, text_writer
from ..model import GPT
from ..sampling import Sampling, gumbel_top_k, q_log_probs, residual_after_miss, sampling_probs, without_earlier_draws
from ..tree import check_acc

ACCURACY_FILE = "heads_accuracy.json"
ROWS, POSITIONS = 16, 256  # rows per greedy batch, positions per heads call: bound the cache and [K, m, M] logits


def continuations(model: GPT, prompts: list[list[int]], *, max_new_tokens: int, temperature: float = 0.0,
                  seed: int = 0) -> list[list[int]]:
    """Each prompt + the backbone's continuation (temperature 0: greedy), ROWS prompts at a time, one generator."""
    out, sampling, g = [], Sampling(temperature=temperature), torch.Generator(device=model.device).manual_seed(seed)
    for b in range(0, len(prompts), ROWS):
        part = prompts[b : b + ROWS]
        rows = generate_batch(model, part, max_new_tokens=max_new_tokens, sampling=sampling, generator=g)
        out += [p + new for p, (new, _) in zip(part, rows)]
    return out


def with_head_targets(sequences: list[list[int]], prompt_lens: int | Sequence[int]) -> Iterator[tuple[list[int], int]]:
    """(sequence, first) where head 1 has a target: `first`, its prompt's last token, is where decoding drafts first."""
    for seq, P in zip(sequences, [prompt_lens] * len(sequences) if isinstance(prompt_lens, int) else prompt_lens):
        first = max(P - 1, 0)
        if len(seq) >= first + 3:  # head 1 at `first` guesses token first + 2
            yield seq, first


@torch.no_grad()
def _mean_per_head(model: GPT, heads: DraftHeads, sequences: list[list[int]], prompt_lens: int | Sequence[int],
                   score: Callable[..., torch.Tensor], shape: tuple[int, ...] = (),
                   temperature: float | None = None) -> torch.Tensor:
    """[K, *shape] float64: score(ids, target [m], p [m, V] or None, logits [m, M]) -> [m, *shape], head k's mean over
    the positions t where it has a target, token t+k+1, from each prompt's last token on, as decoding drafts; ids: the
    draft tokens, p: the backbone's distribution at `temperature`. Hydra heads read the text between t and it."""
    device, K, ids = model.device, heads.num_heads, heads.draft_ids.to(model.device)
    totals, counts = torch.zeros(K, *shape, dtype=torch.float64), torch.zeros(K, dtype=torch.float64)
    for seq, first in with_head_targets(sequences, prompt_lens):
        x, y = torch.tensor([seq[:-1]], device=device), torch.tensor([seq[1:]], device=device)  # [1, T]
        logits, hidden = model(x) if temperature is not None else model(x, logits_at=slice(0, 0))  # hidden [1, T, C]
        p = None if temperature is None else sampling_probs(logits[0], temperature=temperature)  # [T, V]
        following, T = next_tokens(y, K)[0], x.shape[1]  # [T, K]
        for t in torch.arange(first, T - 1, device=device).split(POSITIONS):  # head 1 has a target
            head_logits = heads(hidden[0, t], model, following=following[t])  # [K, m, M]
            for k in range(1, K + 1):
                ok = t + k < T  # [m] token t+k+1 is y[0, t + k]
                rows = score(ids, y[0, t[ok] + k], None if p is None else p[t[ok] + k], head_logits[k - 1, ok])
                totals[k - 1] += rows.double().sum(0).cpu()
                counts[k - 1] += ok.sum().item()
    return totals / counts.clamp(min=1).view(K, *[1] * len(shape))


def measure_head_accuracy(model: GPT, heads: DraftHeads, sequences: list[list[int]], *,
                          prompt_lens: int | Sequence[int], top_k: int = 10) -> torch.Tensor:
    """acc [K, top_k] float64 (module docstring) on `sequences`: prompts + their greedy continuations."""
    hits = lambda ids, target, p, logits: ids[logits.topk(top_k, dim=-1).indices] == target[:, None]  # [m, top_k]
    return _mean_per_head(model, heads, sequences, prompt_lens, hits, shape=(top_k,))


def measure_sampled_acceptance(model: GPT, heads: DraftHeads, sequences: list[list[int]], *,
                               prompt_lens: int | Sequence[int], temperature: float) -> torch.Tensor:
    """[K] float64: head k's Σ_x min(p(x), q_k(x)) at `temperature`, averaged over `sequences` (continuations
    sampled at it): the chance that rejection sampling accepts head k's one drawn candidate."""
    sum_min = lambda ids, target, p, logits: torch.minimum(  # q [m, M]: 0 outside the draft ids
        p[:, ids], sampling_probs(logits, temperature=temperature)).sum(-1)
    return _mean_per_head(model, heads, sequences, prompt_lens, sum_min, temperature=temperature)


def measure_try_acceptance(model: GPT, heads: DraftHeads, sequences: list[list[int]], *,
                           prompt_lens: int | Sequence[int], temperature: float, ranks: int = 10, repeats: int = 4,
                           seed: int = 0) -> torch.Tensor:
    """acc [K, ranks] float64: acc[k][r] = P(head k+1's r-th distinct draw from q is the candidate rejection
    sampling's tries accept), on text sampled at `temperature`, over `repeats` sets of draws per position. At
    most one sibling passes, as at most one top-k guess is the greedy token, so the table plays greedy's part
    in `tree.build_tree`, approximately. acc[k][0] estimates Σ min(p, q), exactly in expectation."""
    V, R = model.config.vocab_size, min(ranks, heads.draft_ids.numel())
    g = torch.Generator(device=model.device).manual_seed(seed)

    def passed(ids: torch.Tensor, target: torch.Tensor, p: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        log_q = q_log_probs(logits, ids, temperature=temperature, vocab_size=V).repeat(repeats, 1)  # [repeats * m, V]
        u = torch.rand(log_q.shape, generator=g, device=model.device)  # every repeat's draws in one call
        return draw_chances(p.repeat(repeats, 1), log_q, gumbel_top_k(log_q, R, u)).view(repeats, len(p), R).mean(0)
    return _mean_per_head(model, heads, sequences, prompt_lens, passed, shape=(R,), temperature=temperature)


def draw_chances(p: torch.Tensor, log_q: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """[m, R] float64: the chance, over the uniforms, that draw k of draws [m, R] (distinct draws from q,
    log_q [m, V], in order) is the one rejection sampling's tries accept against p [m, V]: Π_{j<k} (1 - a_j)
    · a_k, a_k = min(1, r_k(x_k) / q_k(x_k)), r_k the target the misses before it left (r_0 = p), q_k q without
    the draws before it (as `acceptance.rejection_accept_drawn` tries with uniforms)."""
    chances, left = [], torch.ones(len(p), dtype=torch.float64, device=p.device)  # [m] no try passed yet
    target = p  # [m, V]: r, what each try is judged against
    for k, x in enumerate(draws.unbind(1)):  # x: [m], the rank-k draws
        q = without_earlier_draws(log_q, draws, rank=k)  # [m, V]
        residual, mass = residual_after_miss(target, q)  # [m, V], [m]
        live, r_x, q_x = mass > 0, target.gather(1, x[:, None])[:, 0], q.gather(1, x[:, None])[:, 0]  # [m]
        # As the engine's u·q(x) < r(x): where q(x) underflows to 0, or r = q (no residual), x passes iff r(x) > 0.
        ratio = (r_x / q_x.clamp_min(torch.finfo(q_x.dtype).tiny)).clamp(max=1.0)
        chance = torch.where(~live | (q_x <= 0), (r_x > 0).float(), ratio).double()  # [m]
        chances.append(left * chance)
        left = torch.where(live, left * (1 - chance), 0.0)  # r = q (no residual): no later draw is tried
        target = torch.where(live[:, None], residual, target)  # after a miss, the residual is the next try's target
    return torch.stack(chances, dim=1)


@torch.no_grad()
def measure_marginal_acceptance(model: GPT, sequences: list[list[int]], *, prompt_lens: int | Sequence[int],
                                temperature: float, roots: int = 64, every: int = 4) -> tuple[float, float]:
    """What head 1 would score in `measure_sampled_acceptance` if its q were the exact marginal: (mean Σ min,
    mean root mass covered). Head 1 at t guesses token t+2 without seeing token t+1 (the root r ~ p_t), so
    training on sampled text aims it at m = Σ_r p_t(r) p(· | r); m is taken over the `roots` likeliest roots
    (renormalised) at every `every`-th position. Not an upper bound, but a Medusa head's training target."""
    device, V = model.device, model.config.vocab_size
    total = covered = positions = 0.0
    for seq, first in with_head_targets(sequences, prompt_lens):
        for t in range(first, len(seq) - 2, every):  # as in measure_sampled_acceptance
            context = torch.tensor(seq[: t + 1], device=device)  # [t + 1]
            p_root = sampling_probs(model(context[None])[0][0, -1], temperature=temperature)  # [V]
            w, r = p_root.topk(min(roots, V))  # [R] the likeliest roots and their probabilities
            x = torch.cat([context.expand(len(r), -1), r[:, None]], dim=1)  # [R, t + 2]
            p_next = sampling_probs(model(x)[0][:, -1], temperature=temperature)  # [R, V] p(· | r)
            share = w / w.sum()  # [R]
            total += (share * torch.minimum(p_next, share @ p_next).sum(-1)).sum().item()  # share @ p_next: m [V]
            covered, positions = covered + w.sum().item(), positions + 1
    return total / max(positions, 1), covered / max(positions, 1)


def save_accuracy(directory: str | os.PathLike, acc: torch.Tensor, *, drawn: torch.Tensor | None = None,
                  meta: dict | None = None) -> None:
    """Write heads_accuracy.json, one line per head: acc (greedy's table), drawn (rejection sampling's), `meta`."""
    def lines(table: torch.Tensor) -> str:
        rows = (json.dumps([round(x, 6) for x in row]) for row in check_acc(table).tolist())
        return "[\n    " + ",\n    ".join(rows) + "\n  ]"
    tables = f'  "acc": {lines(acc)},\n' + (f'  "acc_drawn": {lines(drawn)},\n' if drawn is not None else "")
    rest = json.dumps({"top_k": acc.shape[1], "num_heads": acc.shape[0], **(meta or {})}, indent=2)
    atomic_write(os.path.join(directory, ACCURACY_FILE), text_writer("{\n" + tables + rest[2:] + "\n"))


def load_accuracy(directory: str | os.PathLike, *, drawn: bool = False) -> torch.Tensor | None:
    """Greedy's table [K, R] float64 from heads_accuracy.json, or with `drawn` the drawn candidates' (None where
    an older file has none); a one-line ValueError for a missing or bad file."""
    path = os.path.join(folder := os.fspath(directory), ACCURACY_FILE)
    obj = read_json(path, hint=f"measure it with python -m medusa_mini.cli.measure --ckpt {shlex.quote(folder)}")
    key = "acc_drawn" if drawn else "acc"
    if drawn and isinstance(obj, dict) and key not in obj:
        return None
    try:
        return check_acc(torch.tensor(obj[key], dtype=torch.float64))
    except (TypeError, ValueError, KeyError) as e:
        raise ValueError(f'{path} must hold {{"{key}": [[...], ...]}}: one row of numbers in [0, 1] per head, '
                         f"all of one length; {e}") from None


def format_accuracy(acc: torch.Tensor) -> str:
    """Per head: top-1 and top-5 cumulative acceptance (summed over the first 1 or 5 ranks; fewer if fewer measured)."""
    cum, r = check_acc(acc).cumsum(dim=1), min(5, acc.shape[1])
    return "\n".join([f"head  top-1  top-{r}   (cumulative: accepted among the first r guesses)"]
                     + [f"{k + 1:>4}  {cum[k, 0]:.3f}  {cum[k, r - 1]:.3f}" for k in range(len(cum))])
