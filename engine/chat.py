"""`brass chat [MODEL]`: a conversation in the terminal.

Replies stream as they are generated. The whole conversation goes through the model's chat
template every turn; the session (its KV cache) is kept between turns, and a turn reads only
the tokens after the longest common prefix of its prompt and what the session holds (the last
prompt and the reply generated from it): usually the new message and the template's tokens
around it. Where the re-rendered reply tokenizes differently from the tokens generated, the
session goes back to where they part (a KV cache's slots beyond are rewritten). A hybrid
model's recurrent state cannot go back: it resumes from the state kept near the end of the last
prompt (SNAPSHOT_BACK), or starts over when the prompts part before that.
Commands: /reset starts over, /exit (or Ctrl-D) leaves, /help. Ctrl-C stops a reply and keeps
what was said so far in the conversation; Ctrl-C at the prompt clears the line.
"""

from __future__ import annotations

import inspect
import signal
import sys
import time
from typing import Iterator

from .chat_template import ChatTemplate
from .errors import BrassError
from .scheduler import StopScanner

# Tokens before a prompt's end where a hybrid model's recurrent state is kept for the next turn
# (Conversation.reply): more than the template's tokens that follow a message's text.
SNAPSHOT_BACK = 8
HELP = "/reset starts a new conversation, /exit leaves (or Ctrl-D); Ctrl-C stops a reply"


class Conversation:
    """The messages so far, and replies generated from them."""

    def __init__(self, model, sampling, max_tokens: int, system: str | None = None):
        self.model, self.sampling, self.max_tokens, self.system = model, sampling, max_tokens, system
        self.template = ChatTemplate.from_gguf(model.gguf, model.tokenizer)
        self.messages: list[dict] = []
        self.reply_tokens = 0
        self.reply_ids: list[int] = []  # the last reply's tokens
        self.prompt_ids: list[int] = []
        self.prompt_tokens = 0          # the last turn's prompt
        self.read_tokens = 0            # of which it read (the rest were kept)
        self.session = model.new_session()
        # a model whose generate cannot resume a session (--tp) reads every turn afresh
        self.keeps = "cached" in inspect.signature(model.generate).parameters
        self._held: list[int] = []      # the tokens whose keys and values the session holds
        self._snapshot = None           # hybrid: (prompt tokens, recurrent state after them)

    def reset(self):
        self.messages = []
        self.session.reset()
        self._held, self._snapshot = [], None

    def _resume(self, ids: list[int]) -> int:
        """Bring the session to the longest prefix of `ids` it can keep (at most all but the
        last token: its logits give the reply's first token); returns its length."""
        s = self.session
        if not self.keeps:
            s.reset()
            return 0
        held = self._held[:s.n_past]
        n = 0
        for a, b in zip(held, ids[:len(ids) - 1]):
            if a != b:
                break
            n += 1
        if s.cache.recurrent is not None and (n < s.n_past or s.n_past == 0):
            snap = self._snapshot
            s.reset()
            n = 0
            if snap is not None and len(snap[0]) < len(ids) and ids[:len(snap[0])] == snap[0]:
                with self.model.backend.activate():
                    s.cache.recurrent.copy_from(snap[1])
                n = len(snap[0])
        s.n_past = n
        return n

    def reply(self, text: str) -> Iterator[str]:
        """Stream the assistant's answer to `text`; the answer (however far it got when the
        caller stopped) joins the conversation."""
        tok = self.model.tokenizer
        system = [{"role": "system", "content": self.system}] if self.system else []
        messages = self.messages + [{"role": "user", "content": text}]
        ids = tok.encode(self.template.render(system + messages), add_special=True, parse_special=True)
        room = self.model.n_ctx - len(ids)
        if room < 1:
            raise BrassError(f"the conversation ({len(ids)} tokens) has outgrown the context of "
                             f"{self.model.n_ctx} tokens; /reset to start over")
        self.messages = messages
        self.reply_tokens = 0
        parts = []
        decoder = tok.stream_decoder()
        stops = StopScanner(self.template.stop_strings)
        generated: list[int] = []
        self.reply_ids = generated
        gen = None
        try:
            kept = self._resume(ids)
            self.prompt_ids, self.prompt_tokens, self.read_tokens = ids, len(ids), len(ids) - kept
            if self.keeps and self.session.cache.recurrent is not None \
                    and kept < len(ids) - SNAPSHOT_BACK:
                # a hybrid's state is kept SNAPSHOT_BACK tokens before the prompt's end: the
                # next turn's prompt renders this one again, but where the template's last
                # tokens meet the reply's text they may tokenize otherwise
                at = len(ids) - SNAPSHOT_BACK
                self.session.prefill(ids[kept:at])
                self._keep_prompt(ids[:at])
                kept = at
            gen = self.model.generate(ids, min(self.max_tokens, room), self.sampling,
                                      session=self.session, **({"cached": kept} if self.keeps else {}))
            for token in gen:
                generated.append(token)
                self.reply_tokens += 1
                if tok.is_eog(token):
                    break
                piece, hit = stops.feed(decoder.feed(token))
                parts.append(piece)
                yield piece
                if hit:
                    return
            piece, hit = stops.feed(decoder.flush())
            parts.append(piece if hit else piece + stops.flush())
            yield parts[-1]
        except BaseException as e:
            # Ctrl-C (or an error) inside a step may leave a recurrent state advanced part of
            # the way: the next turn starts from the snapshot, or over. (A caller closing the
            # reply stops it between tokens: GeneratorExit leaves the session consistent.)
            if not isinstance(e, GeneratorExit) and self.session.cache.recurrent is not None:
                self.session.reset()
                generated.clear()
                ids = []
            raise
        finally:
            if gen is not None:
                gen.close()
            # the session holds the first n_past of these (a reply's last token is not read)
            self._held = ids + list(generated)
            self.messages.append({"role": "assistant", "content": "".join(parts)})

    def _keep_prompt(self, ids: list[int]):
        """A hybrid's recurrent state after reading `ids`, to resume from."""
        rs = self.session.cache.recurrent
        from .kv_cache import RecurrentState
        with self.model.backend.activate():
            snap = RecurrentState(self.model.backend, self.model.config)
            snap.copy_from(rs)
        self._snapshot = (list(ids), snap)


def run(conv: Conversation):
    """The read–reply loop until /exit or end of input."""
    out, err = sys.stdout, sys.stderr
    try:
        import readline  # noqa: F401  (line editing and ↑/↓ through earlier lines, where available)
    except ImportError:
        pass
    while True:
        try:
            line = input("> ")
        except EOFError:
            out.write("\n")
            return
        except KeyboardInterrupt:
            out.write("\n")
            continue
        command = line.strip()
        if not command:
            continue
        if command in ("/exit", "/quit"):
            return
        if command == "/reset":
            conv.reset()
            out.write("(new conversation)\n")
            continue
        if command in ("/help", "/?"):
            out.write(HELP + "\n")
            continue
        t0 = time.perf_counter()
        stopped = False
        pieces = conv.reply(line)
        try:
            for piece in pieces:
                out.write(piece)
                out.flush()
        except KeyboardInterrupt:
            stopped = True
        except BrassError as e:
            if getattr(conv.model, "failure", None) is not None:
                raise           # --tp: the ranks stopped (a worker died): no later turn can run
            err.write(f"brass: error: {e}\n")
            continue
        finally:
            pieces.close()  # the reply so far joins the conversation now
        dt = time.perf_counter() - t0
        out.write(" [stopped]\n" if stopped else "\n")
        out.flush()
        n = conv.reply_tokens
        err.write(f"[{n} token{'' if n == 1 else 's'}, {n / dt if dt else 0:.1f} tok/s]\n")
        err.flush()


def cmd_chat(args, sampling, load_model):
    from .catalog import model_name
    model = load_model(args)
    name = model_name(args.model, model.path)
    conv = Conversation(model, sampling, args.max_tokens, args.system)
    if conv.template.is_fallback:
        print(f"brass: {name} has no chat template; using ChatML, as llama.cpp does", file=sys.stderr)
    print(f"brass chat: {name} on the {model.backend.name} backend. {HELP}.", file=sys.stderr)
    # Ctrl-C is how a reply is stopped. A process started with SIGINT ignored (a background
    # job of a non-interactive shell, a test harness, an xdist worker's child) would never
    # see it: Python installs its handler only when SIGINT is not ignored at start-up.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    run(conv)


def add_cli(sub, add_model_args, add_sampling_args, sampling_from_args, load_model):
    """`brass chat`, with the command line's own options, checks and loading (engine/cli.py)."""
    p = sub.add_parser("chat", help="interactive chat in the terminal")
    add_model_args(p, model_optional=True)
    p.add_argument("--system", default=None, help="system prompt (default: the template's own, if any)")
    add_sampling_args(p)
    p.set_defaults(func=lambda args: cmd_chat(args, sampling_from_args(args), load_model))
