"""Prompt logprobs for a llama-server, which serves none (it takes `echo: true` and answers with
the generated token's logprobs alone): a proxy (planted.Proxy with no defect) that answers an
echo request to /v1/completions itself, one prompt position at a time, and relays everything
else. lm-eval's
loglikelihood tasks (`local-completions`) ask for echo; conformance/tools/test_lm_eval.py puts
this in front of llama-server so that they run against llama.cpp's own server.

Position j's logprob comes from llama-server itself: its native /completion with the prompt's
first j tokens as ids, one token to generate, the prompt's token j forced by `logit_bias` and
`n_probs`. llama-server reports each token's probability from the logits before sampling
(`post_sampling_probs` false: a softmax over the whole vocabulary in float32), so the bias that
forces the pick does not reach the value. Each request decodes its whole prefix in one batch (the
server runs with --no-cache-prompt, engines.llama_cpp_server), the way the goldens' and lm-eval's
reference teacher-forced decode computes that row, not the one-token decode path a reused cache
would leave it to (but for the first position, whose prefix is one token). A prompt of n tokens costs n requests: this suits lm-eval's short prompts, not
the goldens' long ones (brass conform skips the teacher-forced checks on llama-server and names
why).

The reply has OpenAI's legacy form, as `brass serve` gives it: `tokens` (texts),
`token_logprobs` (the first None) and `top_logprobs` (the first None), and the one generated
token last, with max_tokens 1 (lm-eval asks for that)."""

from __future__ import annotations

import json
import urllib.request

from .planted import Proxy

# the bias that forces the pick: larger than any logit gap a model's softmax holds
FORCE = 1000.0


class EchoAdapter(Proxy):
    def handle(self, h, method: str, body: bytes | None):
        request = json.loads(body) if body else {}
        if not (method == "POST" and h.path == "/v1/completions" and request.get("echo")):
            return super().handle(h, method, body)
        try:
            status, reply = 200, self.echo(request)
        except Exception as e:      # the adapter that breaks says why, as a 500
            status, reply = 500, {"error": {"message": f"echo adapter: {e!r}"}}
        self.send(h, status, json.dumps(reply).encode())

    def llama(self, path: str, request: dict) -> dict:
        """llama-server's own answer (not a route lent to another upstream: the tokenizer too is
        llama-server's here)."""
        req = urllib.request.Request(self.upstream + path, data=json.dumps(request).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=self.timeout) as r:
            return json.loads(r.read())

    def position(self, ids: list[int], k: int, force: int | None) -> tuple[int, str, float, dict]:
        """(token, its text, its logprob, top-k {text: logprob}) of the distribution after `ids`."""
        r = self.llama("/completion", {
            "prompt": ids, "n_predict": 1, "temperature": 0, "n_probs": k, "post_sampling_probs": False,
            "repeat_penalty": 1.0, "cache_prompt": False,
            **({"logit_bias": [[force, FORCE]]} if force is not None else {})})
        (p,) = r["completion_probabilities"]
        if force is not None and p["id"] != force:
            raise RuntimeError(f"llama-server picked {p['id']}, not the forced {force}")
        return p["id"], p["token"], p["logprob"], {t["token"]: t["logprob"] for t in p["top_logprobs"]}

    def echo(self, request: dict) -> dict:
        prompts = request["prompt"]
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if request.get("max_tokens", 16) != 1:
            raise ValueError("the echo adapter generates one token (max_tokens 1, as lm-eval asks)")
        k = max(1, int(request.get("logprobs") or 1))
        choices, n_prompt = [], 0
        for index, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                ids = self.llama("/tokenize", {"content": prompt, "add_special": True,
                                                    "parse_special": True})["tokens"]
            else:
                ids = list(prompt)
            n_prompt += len(ids)
            first = self.llama("/detokenize", {"tokens": ids[:1]})["content"]
            tokens, lps, tops = [first], [None], [None]
            for j in range(1, len(ids)):
                _, text, lp, top = self.position(ids[:j], k, ids[j])
                if lp is None:      # llama-server writes log(0), a probability 0 in float32, as null
                    raise RuntimeError(f"llama-server gives token {ids[j]} at position {j} probability 0")
                tokens.append(text)
                lps.append(lp)
                tops.append(top)
            _, text, lp, top = self.position(ids, k, None)
            tokens.append(text)
            lps.append(lp)
            tops.append(top)
            offsets, n = [], 0
            for t in tokens:
                offsets.append(n)
                n += len(t)
            choices.append({"index": index, "text": "".join(tokens), "finish_reason": "length",
                            "logprobs": {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops,
                                         "text_offset": offsets}})
        return {"object": "text_completion", "model": request.get("model"), "choices": choices,
                "usage": {"prompt_tokens": n_prompt, "completion_tokens": len(choices),
                          "total_tokens": n_prompt + len(choices)}}
