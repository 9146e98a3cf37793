"""The robust arm at the end of training: each arm's final W4A4 damage and final quantized loss (FP + damage,
final weights) against the plain run of the same seed, from a study's robust.parquet.

The report's Robustness table compares damage at the Common Loss and gives the final FP loss; this adds the
final model's damage and quantized loss: paired over seeds (optquant.stats.paired_test: exact or Monte-Carlo
sign-flip p, bootstrap 95 % CI), Holm over the (optimizer, arm) cells of each column. docs/robust-arm.md quotes it.

Run: python docs/robust_final.py docs/robust-arm-arch
"""

import sys

import pandas as pd

from optquant.stats import holm, paired_test


def final_rows(study: str) -> pd.DataFrame:
    r = pd.read_parquet(f"{study}/robust.parquet")
    f = r[r.weights == "final"].pivot_table(index=["optimizer", "seed", "arm"], columns="metric",
                                            values="value").reset_index()
    f["quantized"] = f.val_loss_fp + f.delta_val_loss
    rows = []
    for (opt, arm), g in f[f.arm != "none"].groupby(["optimizer", "arm"]):
        plain = f[(f.arm == "none") & (f.optimizer == opt)].set_index("seed")
        g = g.set_index("seed")
        for what in ("delta_val_loss", "quantized"):
            t = paired_test(g[what], plain[what])
            rows.append(dict(optimizer=opt, arm=arm, what=what, n=t.n, diff=t.mean_diff, lo=t.lo, hi=t.hi, p=t.p,
                             rel=t.mean_diff / plain.loc[g.index.intersection(plain.index), what].mean()))
    d = pd.DataFrame(rows)
    for what in ("delta_val_loss", "quantized"):
        d.loc[d.what == what, "p_holm"] = holm(d.loc[d.what == what, "p"].to_numpy())
    return d


def main() -> None:
    d = final_rows(sys.argv[1])
    print("| optimizer | arm | n | Δ final damage [95 % CI] | change | p_Holm "
          "| Δ final quantized loss [95 % CI] | p_Holm |")
    print("|---|---|---|---|---|---|---|---|")
    for (opt, arm), g in d.groupby(["optimizer", "arm"], sort=False):
        a, q = g[g.what == "delta_val_loss"].iloc[0], g[g.what == "quantized"].iloc[0]
        print(f"| {opt} | {arm} | {a.n} | {a['diff']:+.4f} [{a.lo:+.4f}, {a.hi:+.4f}] | {100 * a.rel:+.1f} % | "
              f"{a.p_holm:.2g} | {q['diff']:+.4f} [{q.lo:+.4f}, {q.hi:+.4f}] | {q.p_holm:.2g} |")


if __name__ == "__main__":
    main()
