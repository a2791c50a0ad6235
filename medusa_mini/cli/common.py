"""What the command-line scripts share: one-line errors, the clock, showing text.

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

R, K = TypeVar("R"), TypeVar("K")
SAMPLING_TEMPERATURE = 0.8  # the command lines' sampling default
BONUS_NOTE = "tokens/step counts the bonus token (the verify pass's own next token)"


def sync_device(device: torch.device | str) -> None:
    """Wait for `device`'s queued work (CUDA runs kernels asynchronously); a no-op on the CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device | str, fn: Callable[[], R]) -> tuple[R, float]:
    """(fn(), the seconds it took on `device`): CUDA events on a GPU, whose kernels run asynchronously (a
    host clock would time their launch), a wall clock elsewhere; the device is idle before and after."""
    sync_device(device)
    if torch.device(device).type != "cuda":
        t0 = time.perf_counter()
        return fn(), time.perf_counter() - t0
    with torch.cuda.device(device):  # events record on the current device's stream: make it `device`'s
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = fn()
        end.record()
    end.synchronize()
    return result, start.elapsed_time(end) / 1e3


def in_turns(calls: dict[K, Callable[[], R]], *, rounds: int, device: torch.device | str,
             before_each: Callable[[], None] | None = None) -> dict[K, list[tuple[R, float]]]:
    """Every call `rounds` times, taking turns (a, b, c, then a, b, c, ...), each `timed`: a change in the
    machine's load then touches every call alike. `before_each` runs untimed before every call."""
    out: dict[K, list[tuple[R, float]]] = {key: [] for key in calls}
    for _ in range(rounds):
        for key, call in calls.items():
            if before_each is not None:
                before_each()
            out[key].append(timed(device, call))
    return out


def as_flags(message: str) -> str:
    """A library message that starts with a setting's name as the flag that sets it: "top_p ..." -> "--top-p ..."."""
    head, _, rest = message.partition(" ")
    return f"--{head.replace('_', '-')} {rest}" if head in ("temperature", "top_p") else message


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors, its own and the script's, are one line: `<prog>: error: <message>`."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(str(message).split())}\n")


def encode_prompt(enc: tiktoken.Encoding, text: str, *, block_size: int) -> list[int]:
    """Token ids of a prompt that leaves room for at least one new token in the context."""
    ids = enc.encode_ordinary(text)
    if not ids:
        raise ValueError("the prompt is empty; give some text with --prompt")
    if len(ids) >= block_size:
        raise ValueError(f"the prompt is {len(ids)} tokens long but the context holds {block_size}; "
                         f"shorten it to at most {block_size - 1} tokens")
    return ids


def token_text(enc: tiktoken.Encoding, token: int) -> str:
    """One token as a quoted literal, so spaces and newlines stay visible: ' the', '\\n'."""
    return repr(enc.decode_single_token_bytes(token).decode("utf-8", errors="replace"))


# Two background colours with black text, so even a step that produced only spaces is visible.
_STEP_STYLES = ("\x1b[30;46m", "\x1b[30;43m")


class StepPrinter:
    """An `on_step` callback that writes the text as it is generated, with show_steps each step in its
    colour (or [brackets]). A UTF-8 character split across two steps waits for its rest."""

    def __init__(self, enc: tiktoken.Encoding, stream, *, eot_id: int | None, show_steps: bool) -> None:
        self.enc, self.stream, self.eot_id, self.show_steps = enc, stream, eot_id, show_steps
        # Colour only on a terminal, and never when NO_COLOR (no-color.org) is set.
        self.color = not os.environ.get("NO_COLOR") and hasattr(stream, "isatty") and stream.isatty()
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.steps = 0

    def __call__(self, tokens: list[int]) -> None:
        self.steps += 1
        self._write(self.decoder.decode(self.enc.decode_bytes([t for t in tokens if t != self.eot_id])))

    def close(self) -> None:
        """Write any held-back bytes (in the last step's style) and end the line."""
        tail = self.decoder.decode(b"", final=True)
        if tail:
            self._write(tail)
        self.stream.write("\n")
        self.stream.flush()

    def _write(self, text: str) -> None:
        if self.show_steps:
            text = f"{_STEP_STYLES[(self.steps - 1) % 2]}{text}\x1b[0m" if self.color else f"[{text}]"
        self.stream.write(text)
        self.stream.flush()  # the reader watches the text grow, step by step


def stat_line(stats: GenerationStats, *, new_tokens: int, block_size: int) -> str:
    """One line: steps, tokens/step (bonus counted), ms/token and why generation stopped."""
    stop = {"context": f"stopped at the context limit: {stats.prompt_tokens} prompt + {new_tokens} new tokens "
                       f"fill all {block_size} positions", "eos": "stopped at the end-of-text token"}
    return (f"{stats.steps} steps, {stats.tokens_per_step:.2f} tokens/step (bonus token counted), "
            f"{1000 * stats.seconds / max(new_tokens, 1):.1f} ms/token, "
            + stop.get(stats.stop_reason, f"stopped after max-new-tokens ({new_tokens})"))
