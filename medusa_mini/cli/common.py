"""What the command-line scripts share: one-line errors, devices and dtypes, clocks, showing text.

Bad input is a one-line ValueError; a script passes it to `OneLineParser.error`, which prints
`<prog>: error: <message>` and exits with status 2 instead of a traceback.
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
    """Wait for `device`'s queued work (CUDA runs kernels asynchronously: a clock read before this
    measures only their launch); a no-op on the CPU."""
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
    return f"--{head.replace('_', '-')} {rest}" if head in ("temperature", "top_p") else message


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr, `<prog>: error: <message>`, exit status 2
    (argparse's own prints the whole usage block first); scripts send their own checks here too."""

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
        raise ValueError(f"the prompt is {len(ids)} tokens long but the context holds {block_size}; "
                         f"shorten it to at most {block_size - 1} tokens")
    return ids


# ---- showing text and numbers ----------------------------------------------------------------


def token_text(enc: tiktoken.Encoding, token: int) -> str:
    """One token as a quoted literal, so spaces and newlines stay visible: ' the', '\\n'."""
    return repr(enc.decode_single_token_bytes(token).decode("utf-8", errors="replace"))


# Two background colours with black text, so even a step that produced only spaces is visible.
_STEP_STYLES = ("\x1b[30;46m", "\x1b[30;43m")


class StepPrinter:
    """An `on_step` callback that writes the text as it is generated, each step in its colour (or in
    [brackets]) with show_steps. An incremental decoder holds back a UTF-8 character split across two
    steps until the rest arrives; the end-of-text token is not printed."""

    def __init__(self, enc: tiktoken.Encoding, stream, *, eot_id: int | None, show_steps: bool, color: bool) -> None:
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
        if self.show_steps:
            text = f"{_STEP_STYLES[(len(self.texts) - 1) % 2]}{text}\x1b[0m" if self.color else f"[{text}]"
        self.stream.write(text)
        self.stream.flush()  # the reader watches the text grow, step by step


def use_color(stream) -> bool:
    """Colour only on a terminal, and never when NO_COLOR (no-color.org) is set."""
    return not os.environ.get("NO_COLOR") and hasattr(stream, "isatty") and stream.isatty()


def stat_line(stats: GenerationStats, *, new_tokens: int, block_size: int) -> str:
    """One line: steps, tokens/step (bonus counted), ms/token and why generation stopped."""
    stop = f"stopped after max-new-tokens ({new_tokens})"
    if stats.stop_reason == "context":
        stop = (f"stopped at the context limit: {stats.prompt_tokens} prompt + {new_tokens} new tokens fill all "
                f"{block_size} positions")
    elif stats.stop_reason == "eos":
        stop = "stopped at the end-of-text token"
    ms = 1000 * stats.seconds / max(new_tokens, 1)
    return f"{stats.steps} steps, {stats.tokens_per_step:.2f} tokens/step (bonus token counted), {ms:.1f} ms/token, {stop}"
