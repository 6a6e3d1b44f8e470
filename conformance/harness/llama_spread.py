"""llama.cpp's own CUDA-vs-CPU spread on a model of the CUDA golden set, and the rule by which
the CUDA backend's bounds against llama.cpp's CUDA goldens scale with it where llama.cpp's own
CPU backend would fail the fixed rule (tolerances.SPREAD_ARGMAX_FACTOR says how and why). Read
by the whole-model tests (conformance/models/test_models.py) and printed by ci/cuda_spread.py."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from conformance.harness import goldens, tolerances


def common_prefix(a, b) -> int:
    """How many leading ids two sequences share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@dataclass(frozen=True)
class Spread:
    """llama.cpp's own CPU backend held to its CUDA goldens of a model as test_teacher_forced
    holds Brass, on the rows both sets cover (each prompt's teacher-forced rows before the two
    sequences' ids part: the same inputs): the clear positions (CUDA margin > ARGMAX_EPS), how
    many of them the two backends' argmax differs at and the largest CUDA margin among those,
    and the worst prompt's top-16 logits NMSE (CPU against CUDA at the ids both top-16 lists
    hold); per prompt, how many greedy tokens the two streams share before they part."""
    clear: int
    disagree: int
    max_margin: float
    top16: float
    shared_tokens: tuple

    @property
    def share(self) -> float:
        return self.disagree / self.clear if self.clear else 0.0


@lru_cache(maxsize=None)
def llama_spread(name: str) -> Spread:
    """llama.cpp's CUDA-vs-CPU spread of a model of the CUDA set (ci/cuda_spread.py prints it)."""
    eps = tolerances.ARGMAX_EPS[("cuda", goldens.model(name).kind)]
    clear = disagree = 0
    max_margin = top16 = 0.0
    shared = []
    for gp, cp in zip(goldens.prompts(name, "cuda"), goldens.prompts(name, "cpu"), strict=True):
        assert gp.name == cp.name, f"{name}: the CUDA and CPU sets hold prompts in another order"
        n = common_prefix(gp.tf_ids, cp.tf_ids)
        is_clear = gp.tf_margin[:n] > eps
        differ = is_clear & (gp.tf_argmax[:n] != cp.tf_argmax[:n])
        clear, disagree = clear + int(is_clear.sum()), disagree + int(differ.sum())
        max_margin = max(max_margin, float(gp.tf_margin[:n][differ].max(initial=0.0)))
        err = ref = 0.0
        for i in range(n):
            cpu = dict(zip(cp.tf_top_ids[i].tolist(), cp.tf_top_logits[i].tolist()))
            for j, x in zip(gp.tf_top_ids[i].tolist(), gp.tf_top_logits[i].tolist()):
                if j in cpu:
                    err, ref = err + (cpu[j] - x) ** 2, ref + x * x
        top16 = max(top16, err / ref if ref else 0.0)
        shared.append(common_prefix(gp.generated_ids, cp.generated_ids))
    return Spread(clear, disagree, max_margin, top16, tuple(shared))


def spread_rule(name: str, backend: str, ref_set: str) -> Spread | None:
    """llama.cpp's own spread on a model where the CUDA backend is held to the CUDA goldens and
    llama.cpp's own CPU backend, held to them by the fixed rule, would fail it (more of its
    clear positions disagree than ARGMAX_MAX_DISAGREEMENT allows): there the teacher-forced
    and greedy bounds scale with that spread (tolerances.SPREAD_ARGMAX_FACTOR says how and
    why). None everywhere else: the fixed rule, unchanged."""
    if (backend, ref_set) != ("cuda", "cuda"):
        return None
    fixed = tolerances.ARGMAX_MAX_DISAGREEMENT.get(
        (backend, ref_set, "moe" if "moe" in goldens.model(name).arch else "dense"), 0.0)
    s = llama_spread(name)
    return s if s.share > fixed else None
