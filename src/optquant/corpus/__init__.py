"""The corpus step at the paper's scale: a web corpus prepared once into token shards (`optquant data prepare`).

sources.py (the input files and their documents, streamed) → tokenizer.py (the user's, or a BPE on a sample)
→ prepare.py (tasks, processes, Slurm, resume) → manifest.py (what training memory-maps, checked).
data.py reads a prepared directory through manifest.py when `data.source` names one; the embedded corpus
and a user's raw files go the way they always did.
"""
