"""Analysis of trained and quantized models (paper.md §4, §6, §7): `capture` (forward hooks),
`outliers` (MMR, kurtosis, kurtRMS), `propagation` (ABC decomposition, R_L; the chain it walks in `chain`,
the gains' linear algebra in `gains`). Import the submodules; metric vs. damage is study/correlate.py."""
