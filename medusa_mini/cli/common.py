"""What the command-line scripts share: argument errors, loading a checkpoint for decoding, showing text.

Every function here turns bad input into a one-line ValueError; a script passes it to
`OneLineParser.error`, which prints `<prog>: error: <message>` and exits with status 2 instead of a
traceback. Nothing here decodes (decoding.py) or loads (io/loading.py).
"""

from __future__ import annotations

import argparse
import codecs
import os
import time
from typing import Callable, NoReturn, TypeVar

import tiktoken
import torch

from ..decoding import GenerationStats
from ..train.device import has_native_bfloat16

R = TypeVar("R")
BONUS_NOTE = "tokens/step counts the bonus token (the verify pass's own next token)"


def sync_device(device: torch.device | str) -> None:
    """Wait for `device` to finish its queued work (CUDA runs kernels asynchronously: a clock read
    before this measures only their launch); a no-op on the CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device | str, fn: Callable[[], R]) -> tuple[R, float]:
    """(fn(), the seconds it took on `device`), the device synchronized before both clock reads."""
    sync_device(device)
    t0 = time.perf_counter()
    result = fn()
    sync_device(device)
    return result, time.perf_counter() - t0


def as_flags(message: str) -> str:
    """A library message that starts with a setting's name, as the flag that sets it: "top_p must be ..."
    -> "--top-p must be ...". Other messages pass unchanged."""
    head, _, rest = message.partition(" ")
    names = {"temperature", "top_p"}
    if head in names:
        return f"--{head.replace('_', '-')} {rest}"
    return message


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr, `<prog>: error: <message>`, exit status 2.

    argparse's own error prints the whole usage block first. Scripts send their own checks (missing
    files, impossible settings) through `error` as well, so every mistake reads the same way.
    """

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(str(message).split())}\n")


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """A --dtype name as a torch dtype; bfloat16 on CUDA only where the GPU computes in it natively
    (compute capability 8.0 and later, asked of `device` itself), not where it is emulated."""
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}: use one of {', '.join(DTYPES)}")
    if name == "bfloat16" and device.type == "cuda" and not has_native_bfloat16(device):
        raise ValueError("this GPU has no native bfloat16 (compute capability below 8.0); "
                         "use --dtype float16 or float32")
    return DTYPES[name]


def pick_device(name: str | None) -> torch.device:
    """'cuda' when available, else 'cpu'; an explicit name must exist on this machine."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"unknown device {name!r}: use cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {name!r} is not supported: use cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but CUDA is not available here; use --device cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"device {name!r} does not exist: this machine has {torch.cuda.device_count()} GPUs")
    return device


def encode_prompt(enc: tiktoken.Encoding, text: str, *, block_size: int) -> list[int]:
    """Token ids of a prompt that leaves room for at least one new token in the context."""
    ids = enc.encode_ordinary(text)
    if not ids:
        raise ValueError("the prompt is empty; give some text with --prompt")
    if len(ids) >= block_size:
        raise ValueError(
            f"the prompt is {len(ids)} tokens long but the context holds {block_size}; "
            f"shorten it to at most {block_size - 1} tokens"
        )
    return ids


# ---- showing text and numbers ----------------------------------------------------------------


def token_text(enc: tiktoken.Encoding, token: int) -> str:
    """One token as a quoted literal, so spaces and newlines stay visible: ' the', '\\n'."""
    return repr(enc.decode_single_token_bytes(token).decode("utf-8", errors="replace"))


# Two background colours with black text, so even a step that produced only spaces is visible.
_STEP_STYLES = ("\x1b[30;46m", "\x1b[30;43m")
_RESET = "\x1b[0m"


def style_step(text: str, index: int, *, color: bool) -> str:
    """One step's text in its colour (alternating by step), or in [brackets] when colour is off."""
    return f"{_STEP_STYLES[index % 2]}{text}{_RESET}" if color else f"[{text}]"


class StepPrinter:
    """An `on_step` callback that writes the text as it is generated, optionally marking each step.

    A UTF-8 character may be split across two steps; an incremental decoder holds its first bytes
    back until the rest arrive, so the joined step texts equal the decoded output. The end-of-text
    token is not printed.
    """

    def __init__(
        self, enc: tiktoken.Encoding, stream, *, eot_id: int | None, show_steps: bool, color: bool
    ) -> None:
        self.enc, self.stream, self.eot_id = enc, stream, eot_id
        self.show_steps, self.color = show_steps, color
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.texts: list[str] = []  # each step's text, unstyled

    def __call__(self, tokens: list[int]) -> None:
        text = self.decoder.decode(self.enc.decode_bytes([t for t in tokens if t != self.eot_id]))
        self.texts.append(text)
        self._write(text)

    def close(self) -> str:
        """Flush any held-back bytes, end the line; return the whole text."""
        tail = self.decoder.decode(b"", final=True)
        if tail:
            self.texts[-1] += tail
            self._write(tail)
        self.stream.write("\n")
        self.stream.flush()
        return "".join(self.texts)

    def _write(self, text: str) -> None:
        step = len(self.texts) - 1
        self.stream.write(style_step(text, step, color=self.color) if self.show_steps else text)
        self.stream.flush()  # the reader watches the text grow, step by step


def use_color(stream) -> bool:
    """Colour only on a terminal, and never when NO_COLOR (no-color.org) is set."""
    if os.environ.get("NO_COLOR"):
        return False
    return hasattr(stream, "isatty") and stream.isatty()


def stop_note(stats: GenerationStats, *, new_tokens: int, block_size: int) -> str:
    if stats.stop_reason == "context":
        return (
            f"stopped at the context limit: {stats.prompt_tokens} prompt + {new_tokens} new tokens "
            f"fill all {block_size} positions"
        )
    if stats.stop_reason == "eos":
        return "stopped at the end-of-text token"
    return f"stopped after max-new-tokens ({new_tokens})"


def stat_line(stats: GenerationStats, *, new_tokens: int, block_size: int) -> str:
    """One line: steps, tokens/step (bonus counted), ms/token and why generation stopped."""
    ms = 1000 * stats.seconds / max(new_tokens, 1)
    return (
        f"{stats.steps} steps, {stats.tokens_per_step:.2f} tokens/step (bonus token counted), "
        f"{ms:.1f} ms/token, {stop_note(stats, new_tokens=new_tokens, block_size=block_size)}"
    )
