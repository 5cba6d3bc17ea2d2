"""Synthetic learning curves whose best configurations start slow and overtake fast ones late.

Families of objectives (``FAMILIES``), one objective per family and seed, deterministic:
``curve(params, seed, family)`` is the score (in [0, 1], higher is better) after each of EPOCHS
epochs. All families share what a seed draws (below) and a configuration's quality ``q``;
they differ in the shape of the curves:

- ``crossing``: a saturating exponential, a power law or a delayed sigmoid per architecture,
  the best configurations slowest (the family described below);
- ``plateau``: every configuration climbs fast to a plateau, then jumps to its asymptote at
  an epoch of its own; the better the configuration, the lower its plateau and the later
  its jump (epoch 3 to about 16, later for a wider model or a smaller rate), so until the
  jumps the best look worst;
- ``power``: a power law in the epochs, ``(e / EPOCHS)^b``, whose exponent ``b`` grows with
  the quality and varies per configuration (a random factor of 0.75-1.33), with noise that
  is large early (σ 0.015 at epoch 1, 0.005 late): slow, noisy crossings over the whole run.

What a seed draws:

- for each architecture (``arch``), the learning rate and momentum it does best with, its
  ceiling, and the shape of its curves: a saturating exponential, a power law, or a delayed
  sigmoid (a warm-up before it learns), assigned anew per seed so that no shape is the
  winner's by construction;
- a configuration's quality ``q`` in [0, 1]: how close its learning rate (in log) and
  momentum are to its architecture's best, and how wide it is. Its asymptote rises with
  ``q``, and its speed falls with it: the best configurations learn slowest, so ranking by
  early epochs picks the wrong ones, and curves cross;
- a small noise per epoch, the same for the same configuration and seed.

Nothing here was fitted to a search method: the parameters were set once, for curves that
cross in the middle third of training (see ``crossing``).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from typing import Any

EPOCHS = 27
SPACE: dict[str, Any] = {
    "lr": {"_type": "loguniform", "_value": [1e-4, 1.0]},
    "momentum": {"_type": "uniform", "_value": [0.0, 0.99]},
    "width": {"_type": "choice", "_value": [64, 128, 256, 512]},
    "arch": {"_type": "choice", "_value": ["mlp", "cnn", "res"]},
}
SHAPES = ("exp", "power", "sigmoid")
FAMILIES = ("crossing", "plateau", "power")


def _world(seed: int) -> dict[str, dict[str, Any]]:
    rng = random.Random(f"slowcurves-{seed}")
    shapes = list(SHAPES)
    rng.shuffle(shapes)
    ceilings = sorted((rng.uniform(0.80, 0.86), rng.uniform(0.86, 0.90), rng.uniform(0.90, 0.95)))
    rng.shuffle(ceilings)
    return {
        arch: {"lr": rng.uniform(-3.3, -1.5), "momentum": rng.uniform(0.5, 0.95), "ceiling": ceilings[i],
               "shape": shapes[i]}
        for i, arch in enumerate(("mlp", "cnn", "res"))
    }


def quality(params: dict[str, Any], seed: int) -> float:
    w = _world(seed)[params["arch"]]
    lr_term = math.exp(-(((math.log10(params["lr"]) - w["lr"]) / 0.7) ** 2))
    m_term = 1.0 - 0.8 * (params["momentum"] - w["momentum"]) ** 2
    width_term = 0.85 + 0.15 * math.log2(params["width"] / 64) / 3
    return max(0.0, min(1.0, lr_term * m_term * width_term))


def curve(params: dict[str, Any], seed: int, family: str = "crossing", noise: bool = True) -> list[float]:
    """The score after each epoch; with ``noise=False`` without its noise per epoch (what the
    configuration is worth: a ``power`` curve's own factor on its exponent stays)."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {family!r}")
    w = _world(seed)[params["arch"]]
    q = quality(params, seed)
    top = w["ceiling"] * (0.45 + 0.55 * q)
    key = json.dumps(params, sort_keys=True)
    rng = random.Random(int.from_bytes(hashlib.sha256(f"{seed}|{key}".encode()).digest()[:8], "big"))
    # A larger rate speeds the start, a wider one slows it.
    by_lr, by_width = (params["lr"] / 10 ** w["lr"]) ** 0.15, (128 / params["width"]) ** 0.25
    rate = by_lr * by_width
    if family == "plateau":
        fracs, sigmas = _plateau(q, rate), [0.004] * EPOCHS
    elif family == "power":
        b = (0.25 + 0.9 * q**2) / rate**0.5 * math.exp(rng.uniform(-0.29, 0.29))
        fracs = [(e / EPOCHS) ** b for e in range(1, EPOCHS + 1)]
        sigmas = [0.003 + 0.012 / e**0.5 for e in range(1, EPOCHS + 1)]
    else:
        fracs, sigmas = _crossing(w["shape"], q, by_lr, by_width), [0.003] * EPOCHS
    return [max(0.0, min(1.0, top * f + (rng.gauss(0.0, s) if noise else 0.0))) for f, s in zip(fracs, sigmas)]


def _crossing(shape: str, q: float, by_lr: float, by_width: float) -> list[float]:
    # The better the configuration, the slower it learns.
    speed = 0.55 * (1.35 - q) ** 2.2 * by_lr * by_width
    out = []
    for epoch in range(1, EPOCHS + 1):
        if shape == "exp":
            frac = 1.0 - math.exp(-speed * epoch)
        elif shape == "power":
            frac = 1.0 - (1.0 + speed * epoch) ** -1.6
        else:  # a warm-up, then a sigmoid
            mid = 2.5 / max(speed, 1e-3)
            frac = (1.0 / (1.0 + math.exp(-speed * 2.2 * (epoch - mid))) - 1.0 / (1.0 + math.exp(speed * 2.2 * mid)))
            frac /= 1.0 - 1.0 / (1.0 + math.exp(speed * 2.2 * mid))
        out.append(frac)
    return out


def _plateau(q: float, rate: float) -> list[float]:
    # A fast climb to a plateau (lower for better configurations), then a jump (later for them).
    level = 0.85 - 0.45 * q
    jump = 3.0 + 13.0 * q**1.3 / rate**0.5
    return [level * (1.0 - math.exp(-0.6 * e)) + (1.0 - level) / (1.0 + math.exp(-(e - jump) / 1.2))
            for e in range(1, EPOCHS + 1)]


def crossing(seed: int, n: int = 400, family: str = "crossing") -> dict[str, float]:
    """How much the early epochs mislead on ``n`` random configurations: the rank correlation
    of the score at epoch 3 and at epoch 9 with the last epoch's, and the last epoch at which
    the eventual best configuration is not yet in the top tenth."""
    rng = random.Random(seed + 1000)
    configs = [
        {"lr": 10 ** rng.uniform(-4, 0), "momentum": rng.uniform(0, 0.99), "width": rng.choice([64, 128, 256, 512]),
         "arch": rng.choice(["mlp", "cnn", "res"])}
        for _ in range(n)
    ]
    curves = [curve(c, seed, family) for c in configs]

    def ranks(xs: list[float]) -> list[float]:
        order = sorted(range(len(xs)), key=lambda i: xs[i])
        r = [0.0] * len(xs)
        for k, i in enumerate(order):
            r[i] = float(k)
        return r

    def spearman(a: list[float], b: list[float]) -> float:
        ra, rb = ranks(a), ranks(b)
        ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
        cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
        return cov / math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))

    last = [c[-1] for c in curves]
    best = max(range(n), key=lambda i: last[i])
    late = 0
    for e in range(EPOCHS):
        at = sorted((c[e] for c in curves), reverse=True)
        if curves[best][e] < at[n // 10]:
            late = e + 1
    return {"spearman_e3": spearman([c[2] for c in curves], last),
            "spearman_e9": spearman([c[8] for c in curves], last), "best_outside_top_tenth_until_epoch": late}


if __name__ == "__main__":
    for fam in FAMILIES:
        for s in range(5):
            print(fam, s, _world(s), crossing(s, family=fam))
