"""Analysis of trained and quantized models (paper.md §4, §6, §7): `capture` (forward hooks),
`outliers` (MMR, kurtosis, kurtRMS), `propagation` (ABC decomposition, R_L, gains), `correlate`
(metric vs. PTQ damage across models) and `common_loss` (the CL protocol). Import the submodules."""
