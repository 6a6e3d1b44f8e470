"""`brass chat`: the conversation it keeps (in-process), and the terminal program in a
pseudo-terminal: a streamed reply, Ctrl-C stopping a reply without leaving, /reset, Ctrl-D.
Measured on 2 cores: seconds on an otherwise idle machine (3.6 s before the Gemma test), ~1 min when other work
shares the cores (the Gemma fallback test loads a second model)."""

from __future__ import annotations

import os
import re
import select
import signal
import sys
import time
from pathlib import Path

import pytest

from brass.chat import Conversation
from brass.chat_template import ChatTemplate
from brass.errors import BrassError
from brass.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m"
N_CTX = 256
WORDS = "sea ship storm harbor light wind stone river bread garden winter candle".split()


@pytest.fixture(scope="module")
def model(shared_model):
    return shared_model(MODEL, "numpy", n_ctx=N_CTX)     # the one test_server*.py use too


def greedy_reply(model, messages, max_tokens) -> str:
    """The engine's own greedy answer to `messages`, decoded in one piece."""
    tok = model.tokenizer
    prompt = ChatTemplate.from_gguf(model.gguf, tok).render(messages)
    ids = tok.encode(prompt, add_special=True, parse_special=True)
    tokens = list(model.generate(ids, max_tokens=max_tokens, sampling=SamplingParams(temperature=0.0)))
    if tokens and tok.is_eog(tokens[-1]):
        tokens.pop()
    return tok.decode(tokens)


def test_conversation_keeps_history_and_resets(model, rng):
    system = "Be brief."
    conv = Conversation(model, SamplingParams(temperature=0.0), max_tokens=4, system=system)
    first = " ".join(rng.choice(WORDS, size=3))
    reply1 = "".join(conv.reply(first))
    sys_msg = [{"role": "system", "content": system}]
    assert reply1 == greedy_reply(model, sys_msg + [{"role": "user", "content": first}], 4)
    assert conv.messages == [{"role": "user", "content": first}, {"role": "assistant", "content": reply1}]
    second = " ".join(rng.choice(WORDS, size=3))
    reply2 = "".join(conv.reply(second))
    # The second answer is the one the model gives with the first exchange in its prompt.
    assert reply2 == greedy_reply(model, sys_msg + conv.messages[:3], 4)
    assert [m["role"] for m in conv.messages] == ["user", "assistant", "user", "assistant"]
    conv.reset()
    assert conv.messages == []
    assert "".join(conv.reply(first)) == reply1


def test_stopped_reply_stays_as_far_as_it_got(model, rng):
    conv = Conversation(model, SamplingParams(temperature=0.0), max_tokens=6, system="Be brief.")
    pieces = conv.reply(" ".join(rng.choice(WORDS, size=3)))
    first = next(pieces)
    pieces.close()
    assert conv.messages[-1] == {"role": "assistant", "content": first}
    assert conv.reply_tokens == 1


def test_conversation_longer_than_context_is_a_clear_error(model, rng):
    conv = Conversation(model, SamplingParams(temperature=0.0), max_tokens=4)
    with pytest.raises(BrassError, match="outgrown the context"):
        "".join(conv.reply(" ".join(rng.choice(WORDS, size=N_CTX))))
    assert conv.messages == []


class Terminal:
    """`brass chat` on a pseudo-terminal, so Ctrl-C is the terminal's own interrupt."""

    def __init__(self, args):
        import pty
        self.pid, self.fd = pty.fork()
        if self.pid == 0:
            os.chdir(ROOT)
            # A dumb terminal: no escape sequences from readline among the words we look for.
            os.execve(sys.executable, [sys.executable, "-m", "brass", "chat", *args], {**os.environ, "TERM": "dumb"})
        self.output = b""

    def send(self, data: bytes):
        os.write(self.fd, data)

    def expect(self, pattern: bytes, timeout: float, since: int = 0) -> int:
        """Wait until `pattern` (a regex) appears in the output after offset `since`; return
        the offset just past it."""
        deadline = time.monotonic() + timeout
        while True:
            m = re.search(pattern, self.output[since:])
            if m:
                return since + m.end()
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {pattern!r} within {timeout} s; output:\n"
                                     f"{self.output.decode(errors='replace')}")
            ready, _, _ = select.select([self.fd], [], [], min(left, 0.5))
            if ready:
                try:
                    self.output += os.read(self.fd, 65536)
                except OSError:  # the child closed the terminal
                    raise AssertionError(f"brass chat exited; output:\n{self.output.decode(errors='replace')}") from None

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            try:
                if select.select([self.fd], [], [], 0.2)[0]:
                    self.output += os.read(self.fd, 65536)
            except OSError:
                time.sleep(0.1)
        raise AssertionError("brass chat did not exit")

    def kill(self):
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):  # it has exited and been waited for
            pass
        os.close(self.fd)


def test_terminal_chat_ctrl_c_stops_a_reply_without_exiting(real_model_path):
    # The timeouts only bound a hang; a healthy run answers each step within seconds.
    real_model_path(MODEL)
    term = Terminal([MODEL, "--backend", "numpy", "--ctx", "512", "--max-tokens", "400",
                     "--temperature", "0", "--system", "You tell long stories."])
    try:
        at = term.expect(rb"> ", timeout=120)
        # CPython's readline loop sees a SIGINT that lands between printing the prompt and
        # waiting for input only at the next keystroke; on a busy machine that window can be
        # long, so press Ctrl-C again until the fresh prompt shows (each is "a fresh prompt,
        # not an exit": the chat must still be there).
        for attempt in range(12):
            time.sleep(1)
            term.send(b"\x03")
            try:
                at = term.expect(rb"> ", timeout=5, since=at)
                break
            except AssertionError:
                if attempt == 11:
                    raise
        term.send(b"Tell me a long story about a lighthouse keeper.\r")
        at = term.expect(rb"keeper\.\r\n", timeout=60, since=at)
        at = term.expect(rb"[A-Za-z]{3,}", timeout=120, since=at)  # the reply has begun to stream
        term.send(b"\x03")
        at = term.expect(rb" \[stopped\]\r\n", timeout=60, since=at)
        at = term.expect(rb"\[([0-9]+) tokens?, [0-9.]+ tok/s\]", timeout=60, since=at)
        n = int(re.findall(rb"\[([0-9]+) token", term.output)[-1])
        assert 1 <= n < 400, "the reply was not cut short"
        at = term.expect(rb"> ", timeout=60, since=at)
        term.send(b"/reset\r")
        at = term.expect(rb"\(new conversation\)", timeout=60, since=at)
        at = term.expect(rb"> ", timeout=60, since=at)
        term.send(b"\x04")  # Ctrl-D on an empty line leaves
        assert term.wait(timeout=30) == 0
    finally:
        term.kill()


def test_chatml_fallback_stops_at_its_end_marker(shared_model, let_go_of_shelved_models):
    """Gemma 3 270M has no template: ChatML's `<|im_end|>` is plain text to it, so a reply ends
    where the model writes it, as the engine's own greedy tokens show."""
    gemma = shared_model("gemma3-270m", "numpy", n_ctx=N_CTX)
    conv = Conversation(gemma, SamplingParams(temperature=0.0), max_tokens=8)
    assert conv.template.is_fallback
    reply = "".join(conv.reply("Hello"))
    full = greedy_reply(gemma, [{"role": "user", "content": "Hello"}], 8)
    assert reply == full.split("<|im_end|>")[0], full
