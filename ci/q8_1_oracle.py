"""The numpy backend in q8_1 mode (the CUDA kernels' oracle, kernels/cases.py cuda_reference)
against llama.cpp's CPU goldens: the figures conformance/harness/tolerances.py Q8_1_ORACLE holds for
the models CUDA is held to the CPU set on, measured the way conformance/models/test_models.py
compares (the same nodes, clear positions and near-tie rule), so that those figures can be
re-made rather than pasted.

    python ci/q8_1_oracle.py synth-gemma4 synth-gemma4moe          # entries to paste
    python ci/q8_1_oracle.py synth-qwen35 synth-qwen35moe --check  # and the differences from
                                                                   # the entries there now

Per model it prints the teacher-forced disagreements position by position, where the greedy
stream parts, then the Q8_1_ORACLE entry: activations role -> (worst NMSE at layer 0, worst at
any layer; 0.0 where the role has no layer-0 node), top16 (the teacher-forced top-16 logits'
NMSE on the worst prompt), argmax (disagreeing clear positions / clear positions, the largest
llama.cpp margin among them) and stream (the first parting above STREAM_EPS, or None). NMSEs
are rounded up to two significant digits, margins up to three decimals. CPU only; a synthetic
model takes seconds to a minute.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from conformance.harness import goldens, tolerances  # noqa: E402
from brass.llamacpp import brass_tap  # noqa: E402
from brass.model import Model  # noqa: E402


def nmse(ours: np.ndarray, ref: np.ndarray) -> float:
    # as conformance/models/test_models.py
    return float(((ours.astype(np.float64) - ref) ** 2).sum() / max((ref.astype(np.float64) ** 2).sum(), 1e-30))


def up2(x: float) -> float:
    """x rounded up to two significant digits (the form tolerances.py quotes)."""
    if x <= 0.0:
        return 0.0
    e = math.floor(math.log10(x)) - 1
    return float(f"{math.ceil(x / 10.0 ** e - 1e-9)}e{e}")


def up3_decimals(x: float) -> float:
    return math.ceil(x * 1000 - 1e-6) / 1000


def activations(m: Model, name: str) -> dict:
    """role -> (worst NMSE at layer 0, worst at any layer), unrounded."""
    acts = goldens.activations(name, "cpu")
    traced: dict = {}
    m.score(acts.prompt_ids, trace=lambda key, x: traced.__setitem__(key, m.backend.to_numpy(x)))
    roles: dict = {}
    for key, node in acts.nodes.items():
        if node.role == "moe_topk":
            continue                # expert choice: compared exactly by the test, no figure
        ours, ref = acts.pair(key, traced[brass_tap(node.name, node.role, node.layer)])
        err = nmse(ours, ref)
        l0, any_ = roles.get(node.role, (0.0, 0.0))
        roles[node.role] = (max(l0, err) if node.layer == 0 else l0, max(any_, err))
    return roles


def teacher_forced(m: Model, name: str) -> tuple[float, list, int]:
    """(worst top-16 NMSE over the prompts, [(prompt, position, ours, llama.cpp, margin)], clear)."""
    gm = goldens.model(name)
    eps = tolerances.ARGMAX_EPS[("cpu", gm.kind)]
    worst, bad, checked = 0.0, [], 0
    for p in goldens.prompts(name, "cpu"):
        logits = np.asarray(m.score(p.tf_ids))
        argmax = logits.argmax(axis=-1)
        clear = p.tf_margin > eps
        bad += [(p.name, int(j), int(argmax[j]), int(p.tf_argmax[j]), float(p.tf_margin[j]))
                for j in np.nonzero(clear & (argmax != p.tf_argmax))[0]]
        checked += int(clear.sum())
        ours_top = np.take_along_axis(logits, p.tf_top_ids.astype(np.int64), axis=-1)
        worst = max(worst, nmse(ours_top, p.tf_top_logits))
    return worst, bad, checked


def stream(m: Model, name: str) -> tuple[list, int]:
    """Where the greedy stream parts from llama.cpp's before its first near-tie, prompt by
    prompt ([(prompt, token, margin)]), and how many tokens were compared (test_greedy_stream)."""
    eps = tolerances.STREAM_EPS[goldens.model(name).kind]
    parted, compared = [], 0
    for p in goldens.prompts(name, "cpu"):
        ours = list(m.generate(p.prompt_ids, max_tokens=len(p.generated_ids)))
        step_margin = p.step_top_logits[:, 0] - p.step_top_logits[:, 1]
        tf_margin = p.tf_margin[len(p.prompt_ids) - 1:]
        for i in range(len(p.generated_ids)):
            if step_margin[i] < eps or tf_margin[i] < eps:
                break
            if i >= len(ours) or ours[i] != p.generated_ids[i]:
                parted.append((p.name, i, float(step_margin[i])))
                break
            compared += 1
    return parted, compared


def measure(name: str) -> dict:
    m = Model(goldens.model(name).path(), backend="numpy", act_mode="q8_1", quiet=True)
    roles = activations(m, name)
    top16, bad, checked = teacher_forced(m, name)
    parted, compared = stream(m, name)
    print(f"# {name}: numpy q8_1 vs llama.cpp's CPU goldens")
    for p, j, ours, ref, margin in bad:
        print(f"#   teacher-forced {p} position {j}: q8_1 {ours}, llama.cpp {ref} "
              f"(margin {margin:.3f})")
    for p, i, margin in parted:
        print(f"#   greedy stream {p} parts at token {i} (margin {margin:.3f})")
    print(f"#   {len(bad)} of {checked} clear positions differ; {compared} stream tokens agree before "
          f"a parting or near-tie")
    first = parted[0] if parted else None
    return {
        "activations": {r: (up2(l0), up2(a)) for r, (l0, a) in roles.items()},
        "top16": up2(top16),
        "argmax": ((len(bad), checked), up3_decimals(max((b[4] for b in bad), default=0.0))),
        "stream": f"prompt {first[0]}, token {first[1]}, margin {first[2]:.3f}" if first else None,
        "_raw": {"activations": roles, "top16": top16, "positions": bad, "parted": parted},
    }


def entry_text(name: str, e: dict) -> str:
    items = [f'"{r}": ({l0:.1e}, {a:.1e})' if l0 else f'"{r}": (0.0, {a:.1e})'
             for r, (l0, a) in e["activations"].items()]
    lines, line = [], ""
    for it in items:
        if line and len(line) + len(it) + 2 > 86:          # lines within 100 characters
            lines.append(line + ",")
            line = it
        else:
            line = f"{line}, {it}" if line else it
    lines.append(line + "},")
    (n_bad, n_clear), margin = e["argmax"]
    acts = "\n            ".join(lines)
    stream = "None" if e["stream"] is None else f'"{e["stream"]}"'
    return (f'    "{name}": {{\n        "activations": {{\n            {acts}\n'
            f'        "top16": {e["top16"]:.1e},\n'
            f'        "argmax": ({n_bad} / {n_clear}, {margin:.3f}),\n'
            f'        "stream": {stream},\n    }},')


def differences(name: str, e: dict) -> list[str]:
    """What differs from the entry tolerances.Q8_1_ORACLE holds now. A held figure that is the
    measured one rounded to nearest instead of up (what a hand-pasted entry may hold) is
    named too, as rounding only."""
    old = tolerances.Q8_1_ORACLE.get(name)
    if old is None:
        return [f"{name}: no entry in tolerances.Q8_1_ORACLE"]
    raw, out = e["_raw"], []

    def same(held, rounded, exact, margin=False):
        if math.isclose(held, rounded, rel_tol=1e-9, abs_tol=1e-30):
            return ""
        nearest = round(exact, 3) if margin else float(f"{exact:.1e}")
        return "rounding only" if math.isclose(held, nearest, rel_tol=1e-9, abs_tol=1e-30) else "DIFFERS"

    for role in sorted(set(old["activations"]) | set(e["activations"])):
        a, b = old["activations"].get(role), e["activations"].get(role)
        if a is None or b is None:
            out.append(f"{name} {role}: held {a}, measured {b} (DIFFERS)")
            continue
        for i, where in enumerate(("layer 0", "any layer")):
            why = same(a[i], b[i], raw["activations"][role][i])
            if why:
                measured = raw["activations"][role][i]
                out.append(f"{name} {role} {where}: held {a[i]:.2e}, measured {measured:.4e} "
                           f"-> {b[i]:.1e} ({why})")
    why = same(old["top16"], e["top16"], raw["top16"])
    if why:
        out.append(f"{name} top16: held {old['top16']:.2e}, measured {raw['top16']:.4e} "
                   f"-> {e['top16']:.1e} ({why})")
    (s0, m0), ((n_bad, n_clear), m1) = old["argmax"], e["argmax"]
    if not math.isclose(s0, n_bad / n_clear, rel_tol=1e-9):
        out.append(f"{name} argmax share: held {s0:.4f}, measured {n_bad} / {n_clear} (DIFFERS)")
    worst = max((b[4] for b in raw["positions"]), default=0.0)
    why = same(m0, m1, worst, margin=True)
    if why:
        out.append(f"{name} argmax margin: held {m0}, measured {worst:.5f} -> {m1} ({why})")
    if old.get("stream") != e["stream"]:
        out.append(f"{name} stream: held {old.get('stream')!r}, measured {e['stream']!r} (DIFFERS)")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+", help="golden model names (golden/manifest.json)")
    ap.add_argument("--check", action="store_true",
                    help="also list what differs from tolerances.Q8_1_ORACLE; "
                         "exit 1 if more than rounding does")
    args = ap.parse_args(argv)
    entries = {name: measure(name) for name in args.models}
    print("Q8_1_ORACLE = {")
    for name, e in entries.items():
        print(entry_text(name, e))
    print("}")
    if args.check:
        diffs = [d for name, e in entries.items() for d in differences(name, e)]
        print("\n".join(diffs) if diffs else "every entry as tolerances.Q8_1_ORACLE holds it")
        return 1 if any("rounding only" not in d for d in diffs) else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
