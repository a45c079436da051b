"""Chi-square tests for the sampling tests: Pearson statistics (goodness of fit, two-sample homogeneity)
and critical values at the 0.001 level, without scipy."""

from __future__ import annotations

import torch

# Chi-square critical values at significance 0.001, by degrees of freedom.
_CRITICAL_0001 = {
    1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322, 8: 26.124, 9: 27.877,
    10: 29.588, 11: 31.264, 12: 32.909, 13: 34.528, 14: 36.123, 15: 37.697, 16: 39.252, 17: 40.790,
    18: 42.312, 19: 43.820, 20: 45.315, 21: 46.797, 22: 48.268, 23: 49.728, 24: 51.179,
}




def critical_value(df: int) -> float:
    """The chi-square quantile at 1 - 0.001: tabulated to df 24, then Wilson and Hilferty's approximation."""
    if df in _CRITICAL_0001:
        return _CRITICAL_0001[df]
    z = 3.0902  # the normal's quantile at 1 - 0.001
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


def chi_square_goodness_of_fit(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic and degrees of freedom of ``counts`` [cells] against ``probs`` [cells].

    Cells the model rules out must be empty (asserted). Cells expected to hold fewer than 5 are pooled
    into one bin, merged into the smallest other bin if the pool is itself under 5.
    """
    counts, probs = counts.double().flatten(), probs.double().flatten()
    assert counts[probs == 0].sum() == 0, f"impossible cells were hit: {counts[probs == 0]}"
    expected = probs * counts.sum()
    small = (expected > 0) & (expected < 5)
    observed_bins = counts[expected >= 5].tolist()
    expected_bins = expected[expected >= 5].tolist()
    if small.any():
        pooled_observed, pooled_expected = counts[small].sum().item(), expected[small].sum().item()
        if pooled_expected < 5:
            smallest = min(range(len(expected_bins)), key=expected_bins.__getitem__)
            observed_bins[smallest] += pooled_observed
            expected_bins[smallest] += pooled_expected
        else:
            observed_bins.append(pooled_observed)
            expected_bins.append(pooled_expected)
    statistic = sum((o - e) ** 2 / e for o, e in zip(observed_bins, expected_bins))
    return statistic, len(observed_bins) - 1


def chi_square_homogeneity(counts_a: torch.Tensor, counts_b: torch.Tensor) -> tuple[float, int]:
    """Two-sample Pearson statistic (are both count vectors from the same distribution?) and its df."""
    table = torch.stack([counts_a.double().flatten(), counts_b.double().flatten()])  # [2, cells]
    table = table[:, table.sum(dim=0) > 0]
    expected = table.sum(dim=1, keepdim=True) * table.sum(dim=0, keepdim=True) / table.sum()  # [2, cells]
    statistic = ((table - expected) ** 2 / expected).sum().item()
    return statistic, table.shape[1] - 1


def assert_matches(counts: torch.Tensor, probs: torch.Tensor) -> None:
    """``counts`` [cells] are plausibly drawn from ``probs`` [cells] (0.001 level)."""
    statistic, df = chi_square_goodness_of_fit(counts, probs)
    assert statistic < critical_value(df), f"chi2 = {statistic:.1f} >= {critical_value(df):.1f} (df {df})"


def assert_same_distribution(counts_a: torch.Tensor, counts_b: torch.Tensor) -> None:
    """Both count vectors [cells] plausibly come from one distribution (0.001 level)."""
    statistic, df = chi_square_homogeneity(counts_a, counts_b)
    assert statistic < critical_value(df), f"chi2 = {statistic:.1f} >= {critical_value(df):.1f} (df {df})"
