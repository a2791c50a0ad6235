"""train_tiny.py as a user runs it: stages, checkpoints, the draft vocabulary, exact resume after Ctrl-C
(float16 loss scaling included), bad input, DDP replicas, GPT-2 downloaded once under torchrun."""

import contextlib
import functools
import http.server
import io
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import types

import pytest
import torch

import decode
import train_tiny
from conftest import FAST, ROOT
from medusa_mini.heads import HeadsConfig, frequency_order, make_heads
from medusa_mini.io.checkpoint import load_checkpoint, save_checkpoint
from medusa_mini.io.tokenizer import TOKENIZER_FILES, load_tokenizer, make_encoding, save_tokenizer
from medusa_mini.model import GPT, GPTConfig
from medusa_mini.train import run as run_mod
from medusa_mini.train import state as state_mod
from medusa_mini.train.accuracy import load_accuracy
from medusa_mini.train.config import TrainArgs
from medusa_mini.train.data import load_corpus, split_documents
from medusa_mini.training import MedusaLM
from medusa_mini.tree import build_tree, expected_tokens_per_step, preset

BAD_INPUT = [["--dtype", "float16", "--device", "cpu"], ["--n-embd", "30", "--n-head", "4"], ["--distill-prompts", "0"],
             ["--distill-temperatures", "0,-1"], ["--distill-prompt-len", "64"], ["--distill-prompt-len", "0"],
             ["--heads-batch-size", "0"], ["--resume", "--overwrite"], ["--data", "missing.txt"], ["--dtype", "float8"],
             ["--distill-tokens", "0"], ["--heads-stride", "65"], ["--out", "empty.txt/x"], ["--num-heads", "27"],
             ["--vocab-size", "256"], ["--draft-vocab", "-1"], ["--data", "empty.txt"], ["--eval-prompts", "0"],
             ["--heads-stride", "0"], ["--head-decay", "1.5"], ["--eval-every", "-1"], ["--log-every", "nan"],
             ["--seed", str(2**64)], ["--out", "empty.txt"], ["--max-bytes", "400"], ["--save-every", "0"],
             ["--batch-size", "0"], ["--device", "tpu9"], ["--heads", "eagle"], ["--num-heads", "0"], ["--medusa", "3"],
             ["--max-bytes", "0"], ["--init", "nope"], ["--n-layer", "0"], ["--n-head", "0"], ["--n-embd", "0"],
             ["--lr", "nan"], ["--lr", "inf"], ["--lr", "-1"], ["--out", "z"], ["--out", ""], ["--resume"],
             ["--data", ""], ["--init", ""], ["--eval-prompts", "1001"], ["--preset", "gpt2-cpu"],
             ["--distill-temperatures", "4" + "0" * 38], ["--init", "gpt2", "--distill-prompt-len", "1024"]]
# train_tiny.py as two DDP ranks, under torchrun (one run) or forked from one process (one torch import): for each run
# [Ctrl-C on rank 0 in step n (0: never), *args] of argv[1], prints "exit 0|1"; GPT-2 tokenizer: bytes (no network).
WORKER = r'''
import json, os, signal, socket, sys, tiktoken, train_tiny, torch._dynamo  # an optimizer imports dynamo: 2 s a rank
BYTES = tiktoken.Encoding(name="gpt2", pat_str=r"\s*\S+|\s+", mergeable_ranks={bytes([i]): i for i in range(256)},
                          special_tokens={"<|endoftext|>": 256})
tiktoken.get_encoding = lambda name: BYTES
from medusa_mini.training import MedusaLM
forward, steps = MedusaLM.forward, iter(range(1, 10**6))
def step(self, *args, **kwargs):
    if next(steps) == ctrl_c and os.environ["RANK"] == "0": os.kill(os.getpid(), signal.SIGINT)
    return forward(self, *args, **kwargs)
MedusaLM.forward = step
def rank(**env):
    os.environ.update({k: str(v) for k, v in env.items()}); code = train_tiny.main(argv); sys.stdout.flush()
    os._exit(code)  # gloo's threads abort now and then at interpreter exit, even with the group destroyed
for ctrl_c, *argv in json.loads(sys.argv[1]):
    if "RANK" in os.environ: rank()  # started by torchrun
    with socket.socket() as s:  # rank 0's store listens on a port the OS says is free
        s.bind(("127.0.0.1", 0)); env = dict(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=s.getsockname()[1])
    pids = [os.fork() or rank(RANK=r, LOCAL_RANK=r, **env) for r in (0, 1)]  # a child (fork() 0) runs a rank
    pid, first = os.wait()  # a rank that failed leaves its peer waiting in gloo for 30 minutes: a minute, then stopped
    signal.signal(signal.SIGALRM, lambda *_: os.kill(sum(pids) - pid, signal.SIGKILL)); signal.alarm(60)
    status = os.waitpid(sum(pids) - pid, 0)[1]; signal.alarm(0); print(f"exit {int(bool(status or first))}", flush=True)
'''


def weights(out, backbone_only=False):
    model, heads, _ = load_checkpoint(out)
    return {**model.state_dict(), **({} if backbone_only else {"heads." + k: v for k, v in heads.state_dict().items()})}


def same_weights(a, b, backbone_only=False) -> bool:
    wa, wb = weights(a, backbone_only), weights(b, backbone_only)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def interrupted(argv: list[str], *, during: int, presses: int = 1, owner=MedusaLM, name="forward") -> None:
    """Run train_tiny.main(argv), pressing Ctrl-C (a real SIGINT) `presses` times in the `during`-th call of
    owner.name (default: step): the run stops with exit status 130."""
    real, calls = getattr(owner, name), iter(range(1, 10**6))

    def call(*args, **kwargs):
        if next(calls) == during:
            for _ in range(presses):
                os.kill(os.getpid(), signal.SIGINT)
        return real(*args, **kwargs)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # a shell's background job ignores SIGINT
    with pytest.MonkeyPatch.context() as m:
        m.setattr(owner, name, call)
        assert train_tiny.main(argv) == 130
    signal.signal(signal.SIGINT, previous)


def ddp(tmp_path, *runs: list, torchrun: bool = False, **env) -> subprocess.CompletedProcess:
    """train_tiny.py FAST in two CPU processes of WORKER per run, each [Ctrl-C step, *args], forked, or under torchrun
    (--standalone: its rendezvous takes a port the OS says is free, where a fixed one may still be held)."""
    (tmp_path / "worker.py").write_text(WORKER)
    launch = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"] if torchrun else []
    runs = json.dumps([[step, *FAST, "--device", "cpu", *map(str, args)] for step, *args in runs])
    return subprocess.run([sys.executable, *launch, str(tmp_path / "worker.py"), runs], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, **env})


def checksums(stdout: str) -> list[str]:
    return [line.split()[-1] for line in stdout.splitlines() if "weights sha256" in line]


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    ref, printed = tmp_path_factory.mktemp("ref"), io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert train_tiny.main(FAST + ["--out", str(ref)]) == 0
    return ref, printed.getvalue()


def test_a_run_writes_a_complete_checkpoint_and_a_measured_summary(reference_run):
    out, text = reference_run
    assert set(os.listdir(out)) == {"config.json", "model.safetensors", "medusa_heads.safetensors", "prompts.json",
                                    "medusa_config.json", "heads_accuracy.json", *TOKENIZER_FILES}  # no resume state
    prompts = json.loads((out / "prompts.json").read_text())["prompts"]  # held out: decoding measures unseen text
    val_text = "".join(t for _, t in split_documents(load_corpus(None, max_bytes=60_000), seed=0)[1])
    assert len(prompts) == 2 and all(p in val_text for p in prompts)  # at most a third of 64 tokens each
    assert all(s in text for s in ("tokenizer", "backbone", "8 continuations", "heads", "summary", "official Medusa-1"))
    assert re.search(r"^heads +step +4/4  heads( [\d.]+){4}  top1( [\d.]+){4}  [\d,]+ tok/s  ETA 0m00s$", text, re.M)
    # the summary's expected tokens per step are the product rule on the stored accuracies, and rejection sampling's
    acc, drawn = load_accuracy(out), load_accuracy(out, drawn=True)  # on the drawn candidates' own table
    assert acc.shape == drawn.shape == (4, 10) and not drawn.equal(acc)
    nodes = [", ".join(f"{b} nodes {build_tree(t, b)[1]:.2f}" for b in (4, 8, 16, 32, 64)) for t in (acc, drawn)]
    assert f"{nodes[0]}; cpu preset {expected_tokens_per_step(acc, preset('cpu')):.2f}" in text and nodes[1] in text
    model, heads, cfg = load_checkpoint(out)
    assert heads.num_heads == 4 and cfg["medusa_mini"]["eot_id"] == model.config.vocab_size - 1
    assert cfg["medusa_mini"]["head_top1_own"] == pytest.approx(acc[:, 0].tolist(), abs=1e-4)  # the table's top-1
    assert 4.5 < cfg["medusa_mini"]["val_loss"] < 6  # nats/token, a mean over batches: 6 steps from ln(300) = 5.70
    loss, perplexity = re.search(r"validation loss ([\d.]+) nats/token \(perplexity ([\d.]+)\)", text).groups()
    assert math.exp(float(loss)) == pytest.approx(float(perplexity), rel=1e-3)
    assert heads.draft_ids.numel() == 128  # the smoke preset's --draft-vocab
    accept = cfg["medusa_mini"]["head_accept_sampled"]  # Σ min(p, q) per head, printed as the summary shows it
    assert len(accept) == 4 and all(0 < a < 1 for a in accept)
    assert drawn[:, 0].tolist() == pytest.approx(accept, abs=0.05)  # the drawn table's first try, on the same text
    own = {"Σ min(p, q) on own text": accept, "top-1 vs own greedy": acc[:, 0], "top-5 vs own": acc[:, :5].sum(1)}
    for name, xs in own.items():  # each row printed as the checkpoint stores it
        line = next(line for line in text.splitlines() if name in line)
        assert line.endswith("".join(f"{float(a):7.2f}" for a in xs))
    coverage = cfg["medusa_mini"]["draft_vocab_coverage"]  # the chosen size, and 256 (< 300 tokens)
    assert list(coverage) == ["128", "256"] and f"coverage of greedy text: 128 {coverage['128']:.2f}, 256" in text


@pytest.mark.parametrize("during", [1, 4, 6, "self_distill", 9, 10, "held_out_prompts"])  # backbone 1, 4, 6; heads 3, 4
def test_after_ctrl_c_a_resumed_run_ends_as_an_uninterrupted_one(tmp_path, during, reference_run, capsys):
    """Validation during the run (--eval-every) draws its batches from a generator of their own. Pressed twice in
    step 4, the run stops at once: it resumes from the save --save-every made after step 2."""
    out = tmp_path / "out"
    at = dict(during=1, owner=run_mod, name=during) if isinstance(during, str) else dict(during=during)
    interrupted(FAST + ["--out", str(out), "--eval-every", "2", "--save-every", "2"], **at, presses=1 + (during == 4))
    assert load_checkpoint(out)[1] and not (out / "heads_accuracy.json").exists()  # usable, no table of other heads
    groups = ((state := torch.load(out / "train_state.pt", weights_only=True))["optim"] or {}).get("param_groups", [])
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0] * (len(groups) // 2)  # AdamW: gains and biases exempt
    assert len({round(g["lr"] / g["base_lr"], 9) for g in groups}) <= 1  # one schedule, each group at its own rate
    assert (state["stage"] == "distill") == (during == 6)  # pressed in the last backbone step: before distilling
    assert (state["stage"], state["step"]) == ("heads", 4) or during != "held_out_prompts"  # after it: all 4 kept
    assert train_tiny.main(FAST + ["--out", str(out), "--resume"]) == 0 and "since --resume)" in capsys.readouterr().out
    assert same_weights(reference_run[0], out) and not (out / "train_state.pt").exists()


def test_a_run_never_replaces_a_checkpoint_unless_told_to_and_a_second_ctrl_c_stops_at_once(tmp_path, reference_run,
                                                                                             capsys, monkeypatch):
    """A checkpoint in --out is refused, its files untouched, and so is an --overwrite whose data is bad or whose run
    fails or stops before its first save; that save unmakes the old checkpoint: never a mix of the two runs' files."""
    shutil.copytree(reference_run[0], out := tmp_path / "out")
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    refused = ([], "--overwrite"), (["--resume"], "--overwrite"), (["--overwrite", "--data", "no.x"], "no.x")
    for extra, error in (*refused, (["--overwrite", "--lr", "1e30"], "not finite")):  # failed before its first save
        assert train_tiny.main(FAST + ["--out", str(out), *extra]) == 2 and error in capsys.readouterr().err
    monkeypatch.setattr(state_mod, "atomic_write", lambda *a: (_ for _ in ()).throw(OSError(28, "disk full")))
    pytest.raises(OSError, train_tiny.main, FAST + ["--out", str(out), "--overwrite"])  # its first save: the state
    monkeypatch.undo()
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before
    interrupted(FAST + ["--out", str(out), "--overwrite"], during=2, presses=2)  # stopped before its first save
    assert "before anything was saved" in capsys.readouterr().err
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before
    interrupted(FAST + ["--out", str(out), "--overwrite"], during=2)  # saved after this step: the new run's files alone
    assert "--resume" in capsys.readouterr().err and not {"heads_accuracy.json", "prompts.json"} & set(os.listdir(out))
    assert not same_weights(reference_run[0], out)


def test_medusa_1_trains_the_backbone_alone_as_a_joint_run_without_a_heads_loss(tmp_path, reference_run, capsys,
                                                                                 monkeypatch):
    """--medusa 1 from scratch: next-token training alone, then heads on the frozen backbone (§2.2.1); --medusa 2,
    the default, trains the heads with the backbone, whose progress lines show their losses (§2.2.2). Both guess
    among 2 tokens, fewer than the cpu tree has ranks, and still end with their summary."""
    runs, temperatures, real = [tmp_path / "m1", tmp_path / "l0"], [], run_mod.self_distill
    monkeypatch.setattr(run_mod, "self_distill", lambda *a, **k: temperatures.append(k["temperature"]) or real(*a, **k))
    norms, clip, greedy, continuations = [], torch.nn.utils.clip_grad_norm_, [], run_mod.accuracy.continuations
    monkeypatch.setattr(run_mod.accuracy, "continuations", lambda *a, **k: greedy.append(continuations(*a, **k)) or
                        greedy[-1])  # the summary's: greedy text, then sampled
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda p, norm: norms.append(norm) or clip(p, norm))
    for out, flags in zip(runs, (["--medusa", "1"], ["--lambda0", "0"])):  # 65 prompts: two chunks of 64 at most
        assert train_tiny.main(FAST + ["--out", str(out), "--distill-prompts", "65", *flags, "--draft-vocab", "2"]) == 0
    printed = (capsys.readouterr().out, reference_run[1])
    joint = [[" heads " in line for line in text.splitlines() if line.startswith("backbone  step")] for text in printed]
    assert same_weights(*runs) and not same_weights(runs[0], reference_run[0], backbone_only=True)
    assert joint == [[False] * 4, [True] * 2] and printed[0].count("65 continuations x 12 tokens at T=0,0.8") == 2
    assert temperatures == [0.0, 0.8] * 2 and set(norms) == {1.0}  # chunks greedy, then sampled; gradients clipped to 1
    _, heads, cfg = load_checkpoint(runs[0])  # coverage: the share of greedy tokens among the m most frequent
    ranks = heads.vocab_order.argsort()[torch.tensor([s[16:] for s in greedy[0]])]  # prompts: 64 // 4 tokens
    assert cfg["medusa_mini"]["draft_vocab_coverage"] == {str(m): round((ranks < m).double().mean().item(), 4)
                                                          for m in (2, 256)}


def test_joint_training_ramps_the_heads_weight_moves_their_positions_and_runs_them_faster(monkeypatch):
    """--medusa 2's backbone stage as it hands the loop its settings (§2.2.2): λ ramped over 30% of 10 steps, the
    heads' strided positions moved one each step, their learning rate --heads-lr-mult times the backbone's."""
    got, model = {}, GPT(GPTConfig(vocab_size=300, block_size=64, n_layer=1, n_head=2, n_embd=32))
    r = types.SimpleNamespace(args=TrainArgs(backbone_steps=10), model=model, rank=0, device="cpu",
                              heads=make_heads(HeadsConfig(num_heads=2, n_embd=32, vocab_size=300)))
    monkeypatch.setattr(run_mod, "_train", lambda r, module, lrs, **k: got.update(lrs=lrs, **k))
    run_mod.backbone_stage(r, None, [], state=None)
    assert [lr for _, lr in got["lrs"]] == pytest.approx([1e-3, 4e-3])
    assert [(k["heads_weight"], k["heads_offset"]) for k in map(got["loss_kwargs"], range(4))] == pytest.approx(
        [(0.2 / 3, 0), (0.4 / 3, 1), (0.2, 2), (0.2, 3)])


def test_bfloat16_reaches_float32s_validation_loss_measured_every_eval_every_steps(tmp_path, reference_run, capsys):
    out = tmp_path / "bf16"
    assert train_tiny.main(FAST + ["--out", str(out), "--dtype", "bfloat16", "--eval-every", "4"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("eval ")]
    assert [line.split()[2] for line in lines] == ["4/6", "6/6"] and "validation loss" in lines[0]  # and the last
    f32, bf16 = (load_checkpoint(d)[2]["medusa_mini"]["val_loss"] for d in (reference_run[0], out))
    assert abs(bf16 - f32) <= 0.05 * f32 and not same_weights(reference_run[0], out)  # autocast ran in bfloat16


def test_resume_refuses_other_settings_or_text_and_a_run_never_learns_its_own_output(tmp_path, capsys):
    (data := tmp_path / "data").mkdir()
    (data / "a.py").write_text(text := "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(2000)))
    out = data / "out"  # inside --data: the files the run writes there are not text to learn from
    args = FAST + ["--data", str(data), "--out", str(out), "--seed", str(2**63 - 1)]  # the largest: seed * 7919 wraps
    interrupted(args, during=2)
    saved = (out / "train_state.pt").read_bytes()
    refused = [([], "add --resume")] + [(["--resume", flag, value], f"not {value}: give the flags it began with") for
                                       flag, value in [("--lr", "0.5"), ("--seed", "1"), ("--dtype", "bfloat16")]]
    for extra, error in refused:
        assert train_tiny.main(args + extra) == 2 and error in capsys.readouterr().err
    assert (out / "train_state.pt").read_bytes() == saved
    (data / "a.py").write_text(text.replace("return", "yield"))
    assert train_tiny.main(args + ["--resume"]) == 2 and "not the text this run began" in capsys.readouterr().err
    (data / "a.py").write_text(text)
    state = torch.load(out / "train_state.pt", weights_only=True)
    tokenizer, ranks = {out / n: (out / n).read_bytes() for n in TOKENIZER_FILES}, load_tokenizer(out)._mergeable_ranks
    for damage in (lambda p: p.unlink(), lambda p: p.write_bytes(b"AA== x\n"),  # missing, torn, another run's:
                   lambda p: save_tokenizer(make_encoding({bytes([b]): b for b in range(256)}), out),  # other sizes
                   lambda p: save_tokenizer(make_encoding({t: len(ranks) - 1 - r for t, r in ranks.items()}), out)):
        damage(out / "tokenizer.tiktoken")
        code, err = train_tiny.main(args + ["--resume"]), capsys.readouterr().err
        assert code == 2 and "anew with --overwrite" in err and err.count("\n") == 1
        for file, content in tokenizer.items():  # the run's own again, for the next damage and the rest of the test
            file.write_bytes(content)
    saved = state["data"]  # no text digest; heads taught p; two processes; as this version saves; each with a data path
    for digest, target, world, error in [(None, "token", 1, "not the text"), (saved, "p", 1, "heads_target p,"),
                                         (saved, "token", 2, "began with 2 processes"), (saved, "token", 1, "")]:
        old = {**state["identity"], "heads_target": target, "data": "data"}
        torch.save({**state, "data": digest, "identity": old, "world": world}, out / "train_state.pt")
        assert train_tiny.main(args + ["--resume", "--data", f"{data}/."]) == (2 if error else 0)  # the same text
        assert error in capsys.readouterr().err
    (out / "train_state.pt").write_bytes(b"garbage\n")  # torch explains a refused pickle in six lines
    assert train_tiny.main(args + ["--resume"]) == 2 and capsys.readouterr().err.count("\n") == 1


def test_help_lists_every_flag_and_bad_flags_or_data_are_one_line_naming_it_with_code_2(tmp_path, monkeypatch, capsys):
    """--help lists the presets and every hyper-parameter; only the real runs write out/tiny. A bad flag or bad
    data: exit status 2 and one line naming it from main, as `python train_tiny.py` exits with; nothing half-written."""
    exit, text = pytest.raises(SystemExit, train_tiny.parse_args, ["--help"]), capsys.readouterr().out
    assert exit.value.code == 0 and all(f"--{name.replace('_', '-')} " in text for name in TrainArgs.hyper_parameters())
    assert all(flag in text for flag in ("--preset", "--data", "--resume", "--init", "--dtype", "gpt2-cpu"))
    outs = {"--preset cpu": "out/tiny", "--preset gpu": "out/tiny", "--preset smoke": "out/smoke", "--out mine": "mine",
            "--preset gpt2-cpu --init gpt2": "out/gpt2-cpu",
            "--vocab-size 257 --head-decay 1 --heads-stride 256 --eval-prompts 1000": "out/tiny"}  # limits
    assert {a: train_tiny.parse_args(a.split()).out for a in outs} == outs
    cpu = train_tiny.parse_args(["--preset", "cpu"])  # README: a 4-layer GPT, five heads, a draft vocabulary of 512
    assert (cpu.n_layer, cpu.num_heads, cpu.draft_vocab) == (4, 5, 512)
    assert ((a := train_tiny.parse_args(["--init", "gpt2"])).medusa, a.backbone_steps) == (1, 0)  # kept frozen
    assert train_tiny.parse_args(["--init", "gpt2", "--distill-prompt-len", "300"])  # within GPT-2's 1,024, not 256
    cuda = torch.cuda.is_available()  # the presets a device picks: a CPU's finish on a laptop
    assert (a.preset, train_tiny.parse_args([]).preset) == (("gpt2", "gpu") if cuda else ("gpt2-cpu", "cpu"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "z" / "prompts.json").mkdir(parents=True)  # --out z: a folder where a file goes, refused at once
    for bad in BAD_INPUT:
        try:
            code = train_tiny.main([*FAST, "--out", "x/y", *bad])
        except SystemExit as e:  # argparse's own errors
            code = e.code
        err = capsys.readouterr().err
        assert code == 2 and err.startswith("train_tiny.py: error:") and err.count("\n") == 1, (bad, err)
        assert bad[0] in err or bad[-1] in err, (bad, err)
    assert not (tmp_path / "x").exists() and (tmp_path / "z" / "prompts.json").is_dir()  # nothing made or lost
    assert train_tiny.main([*FAST, "--out", "x", "--lr", "1e30", "--save-every", "2"]) == 2  # refused before a save
    assert not (tmp_path / "x").exists()  # nothing written before a save: the folder it made is gone too
    assert "not finite; start again with a lower learning" in (err := capsys.readouterr().err) and err.count("\n") == 1
    least = "--block-size 3 --heads-stride 1 --distill-prompt-len 1 --distill-tokens 2 --num-heads 1".split()
    assert train_tiny.main([*FAST, "--out", "least", *least]) == 0  # the least context the checks let pass: trained

    cpu = "can't allocate memory: you tried to allocate 98 bytes"  # a CPU allocator's first words: a RuntimeError
    for error, said in ((RuntimeError(f"[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: {cpu}. "
                                      "Error code 12"), cpu), (BrokenPipeError(), None)):  # CUDA's: test_compare
        def run(args, error=error):  # fails once --out is made
            os.makedirs(args.out)
            raise error
        monkeypatch.setattr(train_tiny, "run", run)
        with pytest.raises(BrokenPipeError) if said is None else contextlib.nullcontext():  # exit_with's: status 1
            assert train_tiny.main([*FAST, "--out", "x"]) == 2
        assert not (tmp_path / "x").exists() and capsys.readouterr().err == ("" if said is None else f"train_tiny.py: "
            f"error: {said}: lower --batch-size and --overwrite if it saved (the heads stage's: --heads-batch-size, "
            "with --resume)\n")


@pytest.mark.parametrize("stop", ["out of memory", "Ctrl-C"])  # Ctrl-C saves at the heads' step 0: no lr kept
def test_stopped_as_the_heads_begin_a_resume_takes_new_heads_settings_as_if_begun_so(stop, tmp_path, monkeypatch):
    if stop == "Ctrl-C":
        interrupted(args := [*FAST, "--out", str(tmp_path / "run")], during=1, owner=run_mod, name="self_distill")
    else:
        oom = RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 9 bytes. Error code 12")
        monkeypatch.setattr(run_mod, "heads_stage", lambda r, state: (_ for _ in ()).throw(oom))
        assert train_tiny.main(args := [*FAST, "--out", str(tmp_path / "run")]) == 2
        monkeypatch.undo()  # the backbone kept: at a stage's step 0, --resume takes its settings (and later ones') anew
    assert train_tiny.main(args + ["--resume", "--lr", "2e-3"]) == 2  # a finished stage's stay
    fewer, fresh = ["--heads-batch-size", "2", "--heads-lr", "2e-3"], str(tmp_path / "fresh")
    assert train_tiny.main(args + ["--resume", *fewer]) == 0 and train_tiny.main([*FAST, "--out", fresh, *fewer]) == 0
    assert same_weights(tmp_path / "run", fresh)


@pytest.mark.parametrize("said", ["output failed (Broken pipe): saving", "Ctrl-C: saving"])  # `| tee`, Ctrl-C'd
def test_output_that_cannot_be_written_stops_the_run_saved_as_ctrl_c_does(said, tmp_path, monkeypatch, capsys,
                                                                            reference_run):
    lines, real = iter(range(10**6)), print  # `| head -3`: the fourth line meets a closed pipe
    monkeypatch.setattr("builtins.print", lambda *a, **k: real(*a, **k) if k.get("file") or next(lines) < 3 else
                        (_ for _ in ()).throw(BrokenPipeError(32, "Broken pipe")))
    ctrl_c = 2 if said.startswith("Ctrl-C") else 0  # pressed in step 2, whose stdout's reader it stopped too
    interrupted(args := [*FAST, "--out", str(tmp_path / "out")], during=ctrl_c)  # else never: 130 for the output
    monkeypatch.undo()
    assert said in (err := capsys.readouterr().err) and "progress saved" in err
    assert train_tiny.main(args + ["--resume"]) == 0 and same_weights(reference_run[0], tmp_path / "out")


@pytest.mark.slow
def test_two_ddp_processes_keep_identical_replicas_and_resume_exactly_after_ctrl_c_on_one(tmp_path, reference_run):
    cut = tmp_path / "cut"  # Ctrl-C on rank 0 alone in heads step 3: both ranks save and stop; resumed, same weights
    r = ddp(tmp_path, [0, "--out", tmp_path / "ddp"], [9, "--out", cut], [0, "--out", cut, "--resume"])
    assert re.findall(r"^exit (\d)$", r.stdout, re.M) == ["0", "1", "0"], r.stderr[-4000:]
    full, _, resumed, _ = re.split(r"^exit \d\n", r.stdout, flags=re.M)  # both ranks' replicas: one checksum
    assert re.search(r"^backbone +step +1/6  lm 5\.", full, re.M)  # ln 300 = 5.70: a mean over ranks, not a sum
    assert "ranks 2" in full and checksums(resumed) == checksums(full) == [checksums(full)[0]] * 2, r.stderr[-2000:]
    one, two = (weights(out, backbone_only=True) for out in (reference_run[0], tmp_path / "ddp"))  # 1 rank, 2 ranks
    assert max((one[k] - two[k]).abs().max() for k in one) > 1e-4  # rank 1's own batches (the same: 2e-7, rounding)


@pytest.mark.slow
def test_under_torchrun_rank_0_downloads_gpt2_alone_and_every_rank_trains_on_it(tmp_path):
    """Ranks downloading at once would write into one .part file: rank 0 downloads, the others wait."""
    torch.manual_seed(0)
    hub_dir, asked = tmp_path / "hub" / "gpt2" / "resolve" / "main", []
    save_checkpoint(hub_dir, GPT(GPTConfig(vocab_size=257, block_size=64, n_layer=2, n_head=2, n_embd=32)))

    class SlowHub(http.server.SimpleHTTPRequestHandler):  # answers late: both ranks would be mid-download
        def do_GET(self):
            asked.append(self.path)
            time.sleep(1.0)
            super().do_GET()

    with http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                         functools.partial(SlowHub, directory=str(tmp_path / "hub"))) as hub:
        threading.Thread(target=hub.serve_forever, daemon=True).start()
        r = ddp(tmp_path, [0, "--init", "gpt2", "--preset", "gpt2-cpu", "--out", tmp_path / "out"], torchrun=True,
                MEDUSA_MINI_HUB_URL=f"http://127.0.0.1:{hub.server_port}", no_proxy="127.0.0.1",
                MEDUSA_MINI_CACHE=str(tmp_path / "cache"))
        hub.shutdown()
    assert r.returncode == 0, r.stderr[-3000:]
    files, sums = ["config.json", "model.safetensors"], checksums(r.stdout)
    assert sorted(asked) == [f"/gpt2/resolve/main/{file}" for file in files]
    assert sorted(os.listdir(tmp_path / "cache" / "gpt2")) == files
    assert sums == [sums[0]] * 2 and same_weights(hub_dir, tmp_path / "out", backbone_only=True)


def test_init_trains_heads_of_another_kind_on_a_frozen_checkpoint_over_its_own_texts_tokens_and_resumes_exactly(
        tmp_path, monkeypatch, capsys, reference_run):
    """--init with a local GPT-2 layout directory (as the hub's, but written here), replacing an older run
    (--overwrite): heads only, the backbone kept, so head kinds compare fairly on one backbone. The draft vocabulary:
    the --draft-vocab tokens most frequent in what the backbone wrote during self-distillation, prompts left out. Its
    tokenizer: the one beside the weights; for a name (gpt2, ...), tiktoken's, whatever the working folder holds."""
    base, ref, out = reference_run[0], tmp_path / "ref", tmp_path / "out"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tokenizer.tiktoken").write_text("")  # the working folder's: no file that --init names
    (tmp_path / "bare").mkdir()  # a Hugging Face folder's tokenizer_config.json is none of ours
    (tmp_path / "bare" / "tokenizer_config.json").write_text('{"model_max_length": 1024}')
    found = [run_mod.tokenizer_folder(i) for i in ("gpt2", str(base), str(base / "model.safetensors"), "bare")]
    assert found == [None, str(base), str(base), None]
    args = FAST + ["--init", str(base), "--preset", "gpt2-cpu", "--heads", "hydra", "--draft-vocab", "64",
                   "--distill-prompts", "4"]
    assert train_tiny.main(FAST + ["--out", str(ref), "--n-embd", "48", "--backbone-steps", "2"]) == 0  # older run
    written, saves, real, save = [], [], run_mod.self_distill, state_mod.save_checkpoint  # the text; model writes
    monkeypatch.setattr(run_mod, "self_distill", lambda *a, **k: written.append(real(*a, **k)) or written[-1])
    monkeypatch.setattr(state_mod, "save_checkpoint", lambda *a, **k: saves.append(k["write_model"]) or save(*a, **k))
    assert train_tiny.main(args + ["--out", str(ref), "--overwrite"]) == 0
    assert "coverage of greedy text: 64 " in capsys.readouterr().out and saves == [True] + [False] * (len(saves) - 1)
    monkeypatch.undo()
    _, heads, cfg = load_checkpoint(ref)
    assert same_weights(base, ref, backbone_only=True) and cfg["medusa_mini"]["init"] == str(base)
    assert heads.num_heads == 4 and heads.config.kind == cfg["medusa_mini"]["heads"] == "hydra"
    texts = torch.cat(written)[:, 16:]  # the preset's prompts are 16 tokens
    assert set(heads.draft_ids.tolist()) == set(frequency_order(texts, 300)[:64].tolist())
    assert (ref / "tokenizer.tiktoken").read_bytes() == (base / "tokenizer.tiktoken").read_bytes()
    interrupted(args + ["--out", str(out)], during=3)
    for extra, error in ((["--init", str(ref)], "the run began with init "),  # another backbone
                         (["--heads-lr", "2e-3"], "heads_lr 0.001, not 0.002")):  # a begun stage's settings too
        assert train_tiny.main(args + ["--out", str(out), "--resume", *extra]) == 2 and error in capsys.readouterr().err
    assert train_tiny.main(args + ["--out", str(out), "--resume", "--init", f"{base}/"]) == 0 and same_weights(ref, out)
    assert train_tiny.main(args + ["--out", "x", "--block-size", "256", "--distill-prompt-len", "64"]) == 2  # base: 64
    assert "holds 64 tokens of context" in capsys.readouterr().err and not (tmp_path / "x").exists()


@pytest.mark.slow
def test_smoke_preset_end_to_end_medusa_greedy_equals_plain_greedy(tmp_path, capsys, one_run_each):
    """The user's path in small: train the smoke preset, then decode.py --compare --json on it."""
    out = tmp_path / "smoke"
    assert train_tiny.main(["--preset", "smoke", "--out", str(out), "--log-every", "1000", "--seed", "1"]) == 0
    capsys.readouterr()
    # decode.py's default prompts are held-out text: pieces of validation documents, not training text
    train_docs, val_docs = split_documents(load_corpus(None, max_bytes=300_000), seed=1)  # --seed's split
    prompts = json.loads((out / "prompts.json").read_text())["prompts"]
    assert len(prompts) == 4 and all(any(p in t for _, t in val_docs) for p in prompts)
    assert not all(any(p in t for _, t in train_docs) for p in prompts)
    assert decode.main(["--ckpt", str(out), "--compare", "--json", "--max-new-tokens", "48"]) == 0
    medusa = {row["key"]: row for row in json.loads(capsys.readouterr().out)["rows"]}["medusa_greedy"]
    assert medusa["same_as_plain_greedy"] is True and medusa["tokens_per_step"] > 1.0  # plain greedy's tokens, sooner


@pytest.mark.slow
def test_float16_loss_scaling_skips_overflows_and_resumes_exactly(tmp_path, monkeypatch):
    """The real loop with an enabled GradScaler (its state saved with the run in each stage, restored on
    --resume), from 2**17 and growing after every good step: this tiny model's float16 gradients overflow from
    2**18 (backbone) and 2**22 (heads), so the scale a run resumes with decides which steps are skipped."""
    # float16 is refused on a CPU (slow there), but torch's GradScaler runs on one; the summary reads no scaler
    monkeypatch.setattr(train_tiny, "training_dtype", lambda name, device: name)
    monkeypatch.setattr(torch.amp, "GradScaler", functools.partial(torch.amp.GradScaler, init_scale=2.0**17,
                                                                   growth_interval=1))
    monkeypatch.setattr(run_mod, "summarize", lambda *args, **kwargs: ({}, lambda: None))  # left out: most of a run
    args, ref = FAST + ["--dtype", "float16", "--heads-steps", "8"], tmp_path / "ref"
    assert train_tiny.main(args + ["--out", str(ref)]) == 0 and all(v.isfinite().all() for v in weights(ref).values())
    for during in (3, 9):  # backbone step 3, heads step 3
        out = tmp_path / str(during)
        interrupted(args + ["--out", str(out)], during=during)
        saved = torch.load(out / "train_state.pt", weights_only=True)["scaler"]  # {} from a disabled scaler
        assert saved["scale"] != 2.0**17 and saved["growth_interval"] == 1  # the scaler's own state, saved
        assert train_tiny.main(args + ["--out", str(out), "--resume"]) == 0 and same_weights(ref, out), during

    def overflowing(*args, forward=MedusaLM.forward, first=iter([torch.inf]), **kwargs):  # the first step's loss
        loss, metrics = forward(*args, **kwargs)
        return loss * (x := next(first, 1.0)), {k: v * x for k, v in metrics.items()}  # overflows, no other does

    assert train_tiny.main(args + ["--out", str(tmp_path / "lr"), "--lr", "1e30", "--heads-steps", "1"]) == 2  # stopped
    monkeypatch.setattr(MedusaLM, "forward", overflowing)  # float16's scaler skips that step: no divergence to stop
    assert train_tiny.main(args + ["--out", str(tmp_path / "inf")]) == 0
