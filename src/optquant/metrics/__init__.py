"""Analysis of trained and quantized models (paper.md §4, §6, §7): `capture` (forward hooks),
`outliers` (MMR, kurtosis, kurtRMS), `propagation` (ABC decomposition, R_L, gains) and `correlate`
(metric vs. PTQ damage across models). Import the submodules."""
