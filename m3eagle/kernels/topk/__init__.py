"""Top-k of small k over rows of scores, in score order with ties to the lower index (a stable descending
sort's first k): the plain torch version in `reference.py` (the CPU path and the oracle) and one Triton launch
per call in `triton_topk.py` (draft-tree growth: the head's vocabulary per frontier node, the rerank)."""
