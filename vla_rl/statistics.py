"""Statistics the commands and benchmarks report with."""

from __future__ import annotations

import math


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a binomial proportion; it always holds the observed rate."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    # The interval holds p exactly; rounding left its upper end a hair below 1 at p = 1 (100 of 100:
    # 0.9999999999999999), which made an error bar negative and a plot refuse it.
    return max(0.0, min(p, centre - half)), min(1.0, max(p, centre + half))


def mcnemar_exact(only_first: int, only_second: int) -> float:
    """Two-sided exact McNemar p-value of paired binary outcomes: ``only_first`` pairs where the first
    succeeded and the second failed, ``only_second`` the reverse. Under the null each discordant pair goes
    either way with probability 1/2: p = min(1, 2 * P(Binomial(b + c, 1/2) <= min(b, c))); 1 when there is
    no discordant pair."""
    n = only_first + only_second
    if n == 0:
        return 1.0
    k = min(only_first, only_second)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def pooled_rate(results: list[dict]) -> dict:
    """Success results (each with ``successes`` and ``episodes``) pooled: the summed counts, their rate and
    its 95% Wilson interval, as one evaluation of all the episodes would report them."""
    successes, episodes = sum(r["successes"] for r in results), sum(r["episodes"] for r in results)
    return {
        "episodes": episodes, "successes": successes, "success_rate": successes / episodes if episodes else 0.0,
        "success_ci95": list(wilson_interval(successes, episodes)),
    }  # fmt: skip


def rate_ratio_interval(successes: int, n: int, base_successes: int, base_n: int, z: float = 1.96):
    """95% Katz log interval of the ratio of two success rates, (successes / n) / (base_successes / base_n),
    treating them as independent binomials (so wider than a paired interval where the episodes share initial
    states). With no success on a side, 0.5 is added to each side's successes and failures so that the bounds
    stay finite. Returns (low, high); (nan, nan) when either n is 0."""
    if n == 0 or base_n == 0:
        return float("nan"), float("nan")
    if successes == 0 or base_successes == 0:
        successes, n, base_successes, base_n = successes + 0.5, n + 1, base_successes + 0.5, base_n + 1
    ratio = (successes / n) / (base_successes / base_n)
    spread = z * math.sqrt(1 / successes - 1 / n + 1 / base_successes - 1 / base_n)
    return ratio * math.exp(-spread), ratio * math.exp(spread)
